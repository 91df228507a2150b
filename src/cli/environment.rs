//! What the process was started with, read before and after clap: the
//! `KUBELET_CA_AGENT_<FLAG>` variables and the comma-separated lists.
//!
//! A systemd EnvironmentFile or a pod spec is where most flags are set, and clap knows
//! nothing of it: a misspelt variable (`KUBELET_CA_AGENT_SOURCES`) is ignored in silence,
//! and a bad value is reported under the flag's name, which the operator never typed. So a
//! variable the agent does not read is warned about, naming the closest one it does, and a
//! value that clap refuses is reported under the variable that carried it.

use std::collections::BTreeMap;
use std::ffi::OsString;

use clap::error::{ContextKind, ContextValue, ErrorKind};

use crate::text::escape;

/// The prefix of every variable the agent reads.
pub const PREFIX: &str = "KUBELET_CA_AGENT_";

/// A flag that can be set from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvFlag {
    /// `KUBELET_CA_AGENT_LOG_LEVEL`.
    pub var: String,
    /// `log-level`.
    pub long: String,
    pub short: Option<char>,
    /// A comma-separated list (`--source`, `--authorized-users`, ...).
    pub list: bool,
    /// How clap names it in its errors: `--log-level <LOG_LEVEL>`.
    pub shown: String,
}

/// Every flag of `command` and its subcommands that has a variable, each variable once.
pub fn env_flags(command: &clap::Command) -> Vec<EnvFlag> {
    // Built (defaults filled in) so that an argument can be shown as clap shows it.
    let mut command = command.clone();
    command.build();
    let mut flags: BTreeMap<String, EnvFlag> = BTreeMap::new();
    collect(&command, &mut flags);
    flags.into_values().collect()
}

fn collect(command: &clap::Command, flags: &mut BTreeMap<String, EnvFlag>) {
    for arg in command.get_arguments() {
        let (Some(var), Some(long)) = (arg.get_env(), arg.get_long()) else {
            continue;
        };
        let var = var.to_string_lossy().into_owned();
        flags.entry(var.clone()).or_insert_with(|| EnvFlag {
            var,
            long: long.to_string(),
            short: arg.get_short(),
            list: arg.get_value_delimiter() == Some(','),
            shown: arg.to_string(),
        });
    }
    for sub in command.get_subcommands() {
        collect(sub, flags);
    }
}

/// One warning line for each `KUBELET_CA_AGENT_*` variable in `vars` that no flag reads.
pub fn unknown_variables(
    vars: impl IntoIterator<Item = (OsString, OsString)>,
    flags: &[EnvFlag],
) -> Vec<String> {
    let mut lines = Vec::new();
    for (name, _) in vars {
        let name = name.to_string_lossy();
        if !name.starts_with(PREFIX) || flags.iter().any(|f| f.var == name) {
            continue;
        }
        let hint = match closest(&name, flags) {
            Some(known) => format!("did you mean {known}?"),
            None => format!(
                "the variables are {PREFIX}<FLAG>, the flag's name in upper case with dashes as underscores"
            ),
        };
        lines.push(format!(
            "{} is not a variable kubelet-ca-agent reads, and is ignored: {hint}",
            escape(&name)
        ));
    }
    lines
}

/// The known variable nearest to `name`, if one is near enough to be what was meant.
fn closest<'a>(name: &str, flags: &'a [EnvFlag]) -> Option<&'a str> {
    let suffix = name.strip_prefix(PREFIX).unwrap_or(name);
    flags
        .iter()
        .map(|f| {
            let known = f.var.strip_prefix(PREFIX).unwrap_or(&f.var);
            (edit_distance(suffix, known), f.var.as_str())
        })
        .filter(|(distance, _)| *distance <= 3.min(suffix.chars().count().div_ceil(2)))
        .min()
        .map(|(_, var)| var)
}

/// Levenshtein distance, counted in characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// A comma-separated list as meant: entries trimmed, empty ones (a trailing comma, `a,,b`)
/// dropped. `None` when it is already so.
pub fn tidy_list(value: &str) -> Option<String> {
    let tidy = value
        .split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .collect::<Vec<_>>()
        .join(",");
    (tidy != value).then_some(tidy)
}

/// The command line with every list flag's value tidied ([`tidy_list`]).
pub fn tidy_args(args: Vec<OsString>, flags: &[EnvFlag]) -> Vec<OsString> {
    let lists: Vec<&EnvFlag> = flags.iter().filter(|f| f.list).collect();
    let mut out = Vec::with_capacity(args.len());
    let mut value_of: Option<&EnvFlag> = None;
    let mut rest = false;
    for arg in args {
        if rest {
            out.push(arg);
            continue;
        }
        let Some(text) = arg.to_str() else {
            value_of = None;
            out.push(arg);
            continue;
        };
        if value_of.take().is_some() {
            out.push(tidy_list(text).map_or(arg, OsString::from));
            continue;
        }
        if text == "--" {
            rest = true;
            out.push(arg);
            continue;
        }
        let Some(name) = text.strip_prefix("--") else {
            out.push(arg);
            continue;
        };
        match name.split_once('=') {
            Some((long, value)) if lists.iter().any(|f| f.long == long) => {
                let value = tidy_list(value).unwrap_or_else(|| value.to_string());
                out.push(OsString::from(format!("--{long}={value}")));
            }
            None => {
                value_of = lists.iter().copied().find(|f| f.long == name);
                out.push(arg);
            }
            Some(_) => out.push(arg),
        }
    }
    out
}

/// Whether the command line names `flag` (`--long`, `--long=V`, `-s`, `-sV`), so that
/// its value came from there and not from the environment.
fn on_command_line(args: &[OsString], flag: &EnvFlag) -> bool {
    let long = format!("--{}", flag.long);
    args.iter()
        .skip(1)
        .filter_map(|a| a.to_str())
        .take_while(|a| *a != "--")
        .any(|a| {
            a == long
                || a.strip_prefix(&long).is_some_and(|v| v.starts_with('='))
                || flag.short.is_some_and(|s| {
                    a.strip_prefix('-')
                        .is_some_and(|v| !v.starts_with('-') && v.starts_with(s))
                })
        })
}

/// When clap refused a value that came from the environment, the line to say so instead:
/// `KUBELET_CA_AGENT_LOG_LEVEL=bogus (for --log-level): "bogus" is not a log level: ...`.
/// `env` gives a variable's value as it was set (before [`tidy_list`]).
pub fn explain(
    error: &clap::Error,
    args: &[OsString],
    flags: &[EnvFlag],
    env: impl Fn(&str) -> Option<String>,
) -> Option<String> {
    if !matches!(
        error.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return None;
    }
    let Some(ContextValue::String(shown)) = error.get(ContextKind::InvalidArg) else {
        return None;
    };
    let flag = flags.iter().find(|f| &f.shown == shown)?;
    if on_command_line(args, flag) {
        return None;
    }
    let value = env(&flag.var)?;
    let bad = match error.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(bad)) => bad.clone(),
        _ => value.clone(),
    };
    let why = match (std::error::Error::source(error), error.kind()) {
        (Some(source), _) => source.to_string(),
        (None, ErrorKind::InvalidValue) => match error.get(ContextKind::ValidValue) {
            Some(ContextValue::Strings(valid)) => {
                format!("{bad:?} is not one of {}", valid.join(", "))
            }
            _ => format!("{bad:?} is not a valid value"),
        },
        (None, _) => format!("{bad:?} is not a valid value"),
    };
    Some(format!(
        "{}={} (for --{}): {}",
        flag.var,
        escape(&value),
        flag.long,
        escape(&why)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn flags() -> Vec<EnvFlag> {
        env_flags(&crate::cli::Cli::command())
    }

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn every_flag_of_every_command_is_known_by_its_variable() {
        let flags = flags();
        let find = |var: &str| flags.iter().find(|f| f.var == var).cloned();
        let source = find("KUBELET_CA_AGENT_SOURCE").unwrap();
        assert_eq!(source.long, "source");
        assert!(source.list);
        assert!(find("KUBELET_CA_AGENT_TO").is_some(), "publish's");
        assert!(find("KUBELET_CA_AGENT_RENDERED").is_some(), "drift's");
        let output = find("KUBELET_CA_AGENT_OUTPUT").unwrap();
        assert_eq!(output.short, Some('o'));
        assert!(!find("KUBELET_CA_AGENT_LOG_LEVEL").unwrap().list);
    }

    #[test]
    fn an_unknown_variable_is_named_with_the_closest_known_one() {
        let vars = [
            ("KUBELET_CA_AGENT_SOURCES", "x"),
            ("KUBELET_CA_AGENT_LOGLEVEL", "x"),
            ("KUBELET_CA_AGENT_SOURCE", "x"),
            ("KUBELET_CA_AGENT_WHATEVER_ELSE_ENTIRELY", "x"),
            ("PATH", "/bin"),
            ("KUBELET_CA_BUNDLE", "x"),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        let lines = unknown_variables(vars, &flags());
        assert_eq!(lines.len(), 3, "{lines:#?}");
        assert!(
            lines[0].starts_with("KUBELET_CA_AGENT_SOURCES is not a variable")
                && lines[0].ends_with("did you mean KUBELET_CA_AGENT_SOURCE?"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].ends_with("did you mean KUBELET_CA_AGENT_LOG_LEVEL?"),
            "{}",
            lines[1]
        );
        assert!(!lines[2].contains("did you mean"), "{}", lines[2]);
    }

    #[test]
    fn distances_count_characters() {
        assert_eq!(edit_distance("SOURCES", "SOURCE"), 1);
        assert_eq!(edit_distance("LOGLEVEL", "LOG_LEVEL"), 1);
        assert_eq!(edit_distance("", "AB"), 2);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn lists_drop_empty_entries_and_spaces() {
        assert_eq!(tidy_list("a,b"), None);
        assert_eq!(tidy_list("a, b,").as_deref(), Some("a,b"));
        assert_eq!(tidy_list(" a ,, b ").as_deref(), Some("a,b"));
        let args = os(&[
            "agent",
            "sync",
            "--source",
            "file:/a, file:/b,",
            "--source=dir:/c ,",
            "--bundle",
            "/x, y",
            "--",
            "--source",
            "a, b",
        ]);
        let tidy = tidy_args(args, &flags());
        assert_eq!(
            tidy,
            os(&[
                "agent",
                "sync",
                "--source",
                "file:/a,file:/b",
                "--source=dir:/c",
                "--bundle",
                "/x, y",
                "--",
                "--source",
                "a, b",
            ])
        );
    }

    #[test]
    fn a_bad_value_from_the_environment_is_reported_under_its_variable() {
        use clap::Parser;
        let flags = flags();
        // clap is given the value on its command line; `explain` is told it came from
        // the environment, as it would have without the flag.
        let refused = |given: &[&str], env: (&'static str, &'static str)| {
            let error = crate::cli::Cli::try_parse_from(os(given)).unwrap_err();
            let without = os(&["agent", "version"]);
            explain(&error, &without, &flags, |var| {
                (var == env.0).then(|| env.1.to_string())
            })
        };
        let line = refused(
            &["agent", "--log-level", "bogus", "version"],
            ("KUBELET_CA_AGENT_LOG_LEVEL", "bogus"),
        )
        .unwrap();
        assert!(
            line.starts_with(
                "KUBELET_CA_AGENT_LOG_LEVEL=bogus (for --log-level): \"bogus\" is not a log level"
            ),
            "{line}"
        );
        let line = refused(
            &["agent", "--log-format", "xml", "version"],
            ("KUBELET_CA_AGENT_LOG_FORMAT", "xml"),
        )
        .unwrap();
        assert_eq!(
            line,
            "KUBELET_CA_AGENT_LOG_FORMAT=xml (for --log-format): \"xml\" is not one of text, json"
        );
        let line = refused(
            &["agent", "inspect", "-o", "yaml"],
            ("KUBELET_CA_AGENT_OUTPUT", "yaml"),
        )
        .unwrap();
        assert!(
            line.starts_with("KUBELET_CA_AGENT_OUTPUT=yaml (for --output)"),
            "{line}"
        );

        // Given on the command line: clap's own message, which names the flag, stands.
        let error = crate::cli::Cli::try_parse_from(os(&["agent", "--log-level=bogus", "version"]))
            .unwrap_err();
        let args = os(&["agent", "--log-level=bogus", "version"]);
        assert_eq!(
            explain(&error, &args, &flags, |_| Some("bogus".into())),
            None
        );
        let error =
            crate::cli::Cli::try_parse_from(os(&["agent", "inspect", "-oyaml"])).unwrap_err();
        let args = os(&["agent", "inspect", "-oyaml"]);
        assert_eq!(
            explain(&error, &args, &flags, |_| Some("yaml".into())),
            None
        );
    }
}
