//! The one summary table a benchmark prints at the end: metric, target, measured, result.
//! Printed as a Markdown table, so that docs/performance.md can take it as it is.

use std::time::Duration;

pub struct Table {
    title: String,
    smoke: bool,
    rows: Vec<[String; 4]>,
}

impl Table {
    /// A table; in a `smoke` run (debug build, few iterations) no figure is judged.
    pub fn new(title: &str, smoke: bool) -> Table {
        let title = if smoke {
            format!("{title} (smoke run, debug build: not the figures)")
        } else {
            title.to_string()
        };
        Table {
            title,
            smoke,
            rows: Vec::new(),
        }
    }

    /// A figure with a target from SPEC 11.
    pub fn check(&mut self, metric: &str, target: &str, measured: String, pass: bool) {
        let result = match (self.smoke, pass) {
            (true, _) => "(smoke)",
            (false, true) => "pass",
            (false, false) => "FAIL",
        };
        self.rows
            .push([metric.into(), target.into(), measured, result.into()]);
    }

    /// A figure without a target of its own, shown for context.
    pub fn info(&mut self, metric: &str, measured: String) {
        self.rows
            .push([metric.into(), "-".into(), measured, "info".into()]);
    }

    pub fn print(&self) {
        let header = ["metric", "target", "measured", "result"];
        let mut width = header.map(str::len);
        for row in &self.rows {
            for (w, cell) in width.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |cells: [&str; 4]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(width)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            println!("| {} |", padded.join(" | "));
        };
        println!();
        println!("## {}", self.title);
        println!();
        println!("{}", machine());
        println!();
        line(header);
        line(width.map(|w| "-".repeat(w)).each_ref().map(String::as_str));
        for row in &self.rows {
            line(row.each_ref().map(String::as_str));
        }
        println!();
    }
}

pub fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

/// The `p` quantile of `samples`, which it sorts (nearest rank).
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    samples[((samples.len() as f64 - 1.0) * p).round() as usize]
}

/// The machine the figures come from: cores, CPU model, kernel, the filesystem of the
/// temporary directory (where the benchmarks write), load average at the end.
pub fn machine() -> String {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
        .map_or("unknown CPU", |(_, model)| model.trim());
    let kernel = read("/proc/sys/kernel/osrelease");
    let temp = std::env::temp_dir()
        .canonicalize()
        .unwrap_or_else(|_| std::env::temp_dir());
    // mountinfo: "... mountpoint options [optional...] - fstype source superoptions".
    let mountinfo = read("/proc/self/mountinfo");
    let filesystem = mountinfo
        .lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split(' ').collect();
            let point = *fields.get(4)?;
            let dash = fields.iter().position(|f| *f == "-")?;
            let fstype = *fields.get(dash + 1)?;
            temp.starts_with(point).then_some((point.len(), fstype))
        })
        .max_by_key(|(len, _)| *len)
        .map_or("unknown", |(_, fstype)| fstype);
    let load = read("/proc/loadavg");
    let load: Vec<&str> = load.split(' ').take(3).collect();
    format!(
        "{cores} cores ({cpu}), kernel {}, {} on {filesystem}, load average {}",
        kernel.trim(),
        temp.display(),
        load.join(" ")
    )
}
