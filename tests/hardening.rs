//! The agent never says it is fine while it has stopped doing its job: each test here puts
//! the real binary in a hostile or unlucky spot (a lost watch, an unreadable source, a FIFO,
//! a symbolic link, a flood of probes, exhausted inotify limits, a slow writer, a hook that
//! never ends, a clock jump, control characters) and checks what a user would notice.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use time::Duration as Span;

use common::daemon::{Agent, WITHOUT_INOTIFY, eventually, wait_until};
use common::pki::{self, Algorithm, Signer};
use common::{Node, agent_bin, stderr, stdout};

const SECOND: Duration = Duration::from_secs(1);

fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
}

/// The text a test looks for in `/readyz?verbose`.
fn verbose(agent: &Agent) -> String {
    agent
        .get("/readyz?verbose")
        .map(|(_, body)| body)
        .unwrap_or_default()
}

// 1. A watched directory deleted and recreated, or moved. The agent's confinement holds the
// directories it had at start (a Landlock rule holds an inode, never a path, and is never
// widened): one that is replaced makes the agent say so and exit, and the new agent its
// supervisor starts keeps the new directory. Without Landlock the same agent carries on.

#[test]
fn the_bundle_directory_moved_away_and_recreated_is_kept_by_the_next_agent() {
    let node = Node::new();
    let pem = pki::bundle_of(2, "ca");
    let source = node.source("signers.pem", &pem);
    let mut agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(&pem));
    agent.wait_listening();
    let old = node.root().join("etc/kubernetes.old");
    fs::rename(node.bundle_dir(), &old).unwrap();
    fs::create_dir(node.bundle_dir()).unwrap();
    if agent.exits_when_outgrown(&format!("{} (", node.bundle_dir().display())) {
        // Its supervisor starts it again: confined to the new directory.
        agent = Agent::start(&node, &[&source], &[]);
    }
    // The new directory has no bundle: it is written there, and watched from then on.
    wait_until(5 * SECOND, || node.holds(&pem));
    fs::write(node.bundle(), "overwritten in the new directory").unwrap();
    wait_until(2 * SECOND, || node.holds(&pem));
    // Changes in the directory moved away are not mistaken for the bundle's.
    fs::write(old.join("kubelet-ca.crt"), "not the managed file any more").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(node.holds(&pem));
    agent.wait_metric(SECOND, "kubelet_ca_file_watch_up", 1.0);
    assert!(
        agent
            .metric("kubelet_ca_repairs_total{")
            .is_some_and(|r| r >= 1.0)
    );
}

#[test]
fn a_source_directory_deleted_and_recreated_is_read_again() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let dir = node.root().join("signers");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("a.crt"), a.pem()).unwrap();
    let spec = format!("dir:{}", dir.display());
    let mut agent = Agent::start(&node, &[&spec], &[]);
    wait_until(5 * SECOND, || node.holds(a.pem()));
    fs::remove_dir_all(&dir).unwrap();
    agent.wait_listening();
    // Gone: the last good bundle stays, the source is down, the watch says what it lacks.
    wait_until(2 * SECOND, || verbose(&agent).contains("[-]file-watch"));
    assert!(node.holds(a.pem()));
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("b.crt"), b.pem()).unwrap();
    if agent.exits_when_outgrown(&format!("{} (", dir.display())) {
        assert!(node.holds(a.pem()), "the last good bundle stays");
        agent = Agent::start(&node, &[&spec], &[]);
    }
    wait_until(5 * SECOND, || node.holds(b.pem()));
    // And watched: the next rotation is seen at once.
    fs::write(dir.join("c.crt"), a.pem()).unwrap();
    wait_until(2 * SECOND, || node.holds(b.pem() + &a.pem()));
    wait_until(SECOND, || verbose(&agent).contains("[+]file-watch ok"));
}

// 2. A failed read of a local source is retried with backoff.

#[test]
fn an_unreadable_source_is_read_again_without_any_event() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let lock = node.root().join("locked");
    let dir = lock.join("src");
    fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ca.crt");
    fs::write(&file, a.pem()).unwrap();
    let spec = format!("file:{}", file.display());
    // Root reads through any permission; without these capabilities it cannot.
    let caps = "-dac_override,-dac_read_search";
    let wrapper = [
        "setpriv",
        &format!("--inh-caps={caps}"),
        &format!("--bounding-set={caps}"),
        "--",
    ];
    let agent = Agent::start_wrapped(&node, &[&spec], &[], &wrapper, |_| {});
    wait_until(5 * SECOND, || node.holds(a.pem()));
    agent.wait_listening();
    // The path's parent (not a watched directory) is locked; the rotation's own event
    // makes the agent try, and fail, to read.
    fs::set_permissions(&lock, fs::Permissions::from_mode(0o000)).unwrap();
    fs::write(&file, b.pem()).unwrap();
    wait_until(2 * SECOND, || verbose(&agent).contains("Permission denied"));
    assert_eq!(agent.metric("kubelet_ca_source_up{"), Some(0.0));
    // Unlocked, with no event in any watched directory: only a retry can see it.
    fs::set_permissions(&lock, fs::Permissions::from_mode(0o755)).unwrap();
    wait_until(5 * SECOND, || node.holds(b.pem()));
    agent.wait_metric(SECOND, "kubelet_ca_source_up{", 1.0);
}

// 3. The safety net: every local source and the file are looked at once a minute.

#[test]
fn a_change_no_event_reports_is_picked_up_within_a_minute() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    // The source is a link to a file in a directory nobody watches: inotify never tells.
    let elsewhere = node.root().join("elsewhere");
    fs::create_dir_all(&elsewhere).unwrap();
    fs::write(elsewhere.join("real.crt"), a.pem()).unwrap();
    let linked = node.root().join("sources/linked.crt");
    fs::create_dir_all(linked.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(elsewhere.join("real.crt"), &linked).unwrap();
    let spec = format!("file:{}", linked.display());
    let agent = Agent::start(&node, &[&spec], &[]);
    wait_until(5 * SECOND, || node.holds(a.pem()));
    let staged = elsewhere.join("real.crt.new");
    fs::write(&staged, b.pem()).unwrap();
    fs::rename(&staged, elsewhere.join("real.crt")).unwrap();
    let took = wait_until(70 * SECOND, || node.holds(b.pem()));
    eprintln!("a change behind a link was seen after {took:?}");
    assert!(
        took > SECOND,
        "seen at once: the test no longer tests the safety net"
    );
    agent.wait_listening();
    // After the re-verification the agent waits for the next one, idle: a loop that
    // re-verified at once again would burn ~200 ticks of CPU in 2 s.
    std::thread::sleep(SECOND);
    let before = common::cpu_ticks(agent.child.id());
    std::thread::sleep(2 * SECOND);
    let spent = common::cpu_ticks(agent.child.id()) - before;
    assert!(
        spent < 10,
        "{spent} ticks of CPU in 2 idle seconds after a re-verification"
    );
}

// 4. A FIFO (or another non-regular file) never hangs the daemon.

#[test]
fn a_fifo_at_the_bundle_path_is_replaced_and_the_agent_keeps_answering() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    let source = node.source("signers.pem", &pem);
    fs::create_dir_all(node.bundle_dir()).unwrap();
    mkfifo(&node.bundle());
    // A FIFO named like a temporary file of the agent, which the start-up cleanup looks at.
    mkfifo(
        &node
            .bundle_dir()
            .join(".kubelet-ca.crt.kubelet-ca-agent-tmp.1.1"),
    );
    let mut agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(&pem));
    assert!(fs::symlink_metadata(node.bundle()).unwrap().is_file());
    assert_eq!(agent.get("/livez").map(|(code, _)| code), Some(200));
    // A FIFO moved over the bundle later is repaired the same way.
    let fifo = node.root().join("pipe");
    mkfifo(&fifo);
    fs::rename(&fifo, node.bundle()).unwrap();
    wait_until(2 * SECOND, || node.holds(&pem));
    assert_eq!(agent.get("/livez").map(|(code, _)| code), Some(200));
    assert!(agent.terminate().success());
}

#[test]
fn a_fifo_as_a_source_is_named_and_never_opened() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), &pem).unwrap();
    let pipe = node.root().join("source.pipe");
    mkfifo(&pipe);
    let spec = format!("file:{}", pipe.display());
    let mut agent = Agent::start(&node, &[&spec], &[]);
    agent.wait_listening();
    wait_until(2 * SECOND, || {
        verbose(&agent).contains("is a FIFO (named pipe), not a regular file")
    });
    assert_eq!(agent.get("/livez").map(|(code, _)| code), Some(200));
    // The adopted file stands and the agent is ready on it; the source is reported down.
    assert_eq!(agent.get("/readyz").map(|(code, _)| code), Some(200));
    assert_eq!(agent.metric("kubelet_ca_source_up{"), Some(0.0));
    assert!(agent.terminate().success());
    // `sync` and `inspect` say the same, at once.
    let out = node.sync(&[&spec], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("is a FIFO"), "{}", stderr(&out));
    let out = Command::new(agent_bin())
        .arg("inspect")
        .arg(&pipe)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("is a FIFO"), "{}", stderr(&out));
}

// 5. Concurrent liveness probes share one answer from the loop.

#[test]
fn three_hundred_concurrent_liveness_probes_all_pass() {
    let node = Node::new();
    let source = node.source("signers.pem", pki::bundle_of(1, "ca"));
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    let codes: Vec<Option<u16>> = std::thread::scope(|scope| {
        let probes: Vec<_> = (0..300)
            .map(|i| {
                let agent = &agent;
                scope.spawn(move || {
                    agent
                        .get(if i % 2 == 0 { "/healthz" } else { "/livez" })
                        .map(|(c, _)| c)
                })
            })
            .collect();
        probes.into_iter().map(|p| p.join().unwrap()).collect()
    });
    let failed = codes.iter().filter(|c| **c != Some(200)).count();
    assert_eq!(
        failed, 0,
        "{failed} of 300 probes did not get 200: {codes:?}"
    );
}

// 6. The managed path is a symbolic link.

#[test]
fn a_link_at_the_bundle_path_is_replaced_never_followed() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    let source = node.source("signers.pem", &pem);
    fs::create_dir_all(node.bundle_dir()).unwrap();
    let target = node.root().join("somebody-elses.crt");
    fs::write(&target, "somebody else's file\n").unwrap();
    std::os::unix::fs::chown(&target, Some(65534), Some(65534)).unwrap();
    fs::set_permissions(&target, fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink(&target, node.bundle()).unwrap();
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(&pem));
    let bundle = fs::symlink_metadata(node.bundle()).unwrap();
    assert!(bundle.is_file(), "the link is replaced by a regular file");
    assert_eq!(
        (bundle.uid(), bundle.gid(), bundle.mode() & 0o777),
        (0, 0, 0o644)
    );
    let untouched = fs::metadata(&target).unwrap();
    assert_eq!((untouched.uid(), untouched.mode() & 0o777), (65534, 0o600));
    assert_eq!(
        fs::read_to_string(&target).unwrap(),
        "somebody else's file\n"
    );
    // A link swapped in later, to a file holding the very bundle, is drift all the same:
    // what is behind a link is not the managed file.
    let copy = node.root().join("copy.crt");
    fs::write(&copy, &pem).unwrap();
    let link = node.root().join("link");
    std::os::unix::fs::symlink(&copy, &link).unwrap();
    fs::rename(&link, node.bundle()).unwrap();
    wait_until(2 * SECOND, || {
        fs::symlink_metadata(node.bundle()).unwrap().is_file()
    });
    assert!(agent.log().contains("symbolic link"), "{}", agent.log());
    agent.wait_listening();
    wait_until(SECOND, || verbose(&agent).contains("[+]in-sync ok"));
}

// 7. No source is read past its limit, however large or sparse.

#[test]
fn a_huge_sparse_dir_source_is_refused_within_bounded_memory() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), &pem).unwrap();
    let dir = node.root().join("sparse");
    fs::create_dir_all(&dir).unwrap();
    for i in 0..200 {
        let file = fs::File::create(dir.join(format!("{i:03}.crt"))).unwrap();
        file.set_len(4 << 20).unwrap();
    }
    let spec = format!("dir:{}", dir.display());
    let agent = Agent::start(&node, &[&spec], &[]);
    agent.wait_listening();
    wait_until(5 * SECOND, || {
        verbose(&agent).contains("more than the 4194304-byte limit")
    });
    let peak = agent.peak_rss();
    eprintln!("peak RSS with 800 MiB of sparse source: {} MiB", peak >> 20);
    assert!(peak < 64 << 20, "peak RSS {} MiB", peak >> 20);
    assert!(node.holds(&pem));
}

#[test]
fn inspect_reads_no_more_than_a_bundle_can_hold() {
    let started = Instant::now();
    let out = Command::new(agent_bin())
        .args(["inspect", "-"])
        .stdin(fs::File::open("/dev/zero").unwrap())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("larger than 4 MiB"),
        "{}",
        stderr(&out)
    );
    assert!(started.elapsed() < 30 * SECOND);
    let out = Command::new(agent_bin())
        .args(["inspect", "/dev/zero"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("character device"),
        "{}",
        stderr(&out)
    );
}

// 8. Exhausted inotify limits: the bundle is written anyway, the degraded mode is reported.

#[test]
fn without_inotify_the_agent_writes_the_bundle_and_says_it_runs_on_reverification() {
    let node = Node::new();
    let pem = pki::bundle_of(2, "ca");
    let source = node.source("signers.pem", &pem);
    // A user namespace of its own, where no inotify instance may be created at all.
    let agent = Agent::start_wrapped(&node, &[&source], &[], &WITHOUT_INOTIFY, |_| {});
    wait_until(5 * SECOND, || node.holds(&pem));
    agent.wait_listening();
    let report = verbose(&agent);
    assert!(
        report.contains("[-]file-watch failed: cannot start inotify"),
        "{report}"
    );
    assert!(report.contains("fs.inotify.max_user_instances"), "{report}");
    assert!(report.contains("readyz check passed"), "{report}");
    assert_eq!(agent.metric("kubelet_ca_file_watch_up"), Some(0.0));
    // Drift is still repaired, by the once-a-minute re-verification.
    fs::write(node.bundle(), "overwritten").unwrap();
    let took = wait_until(70 * SECOND, || node.holds(&pem));
    eprintln!("repaired without inotify after {took:?}");
}

// 9. History: pruned by the agent's own order, and only the agent's own entries.

#[test]
fn history_keeps_the_newest_entry_after_the_clock_went_back_and_never_prunes_foreign_files() {
    let node = Node::new();
    let history = node.state_dir().join("history");
    fs::create_dir_all(&history).unwrap();
    // Ten entries written while the clock was years ahead, in the older naming.
    let sha = "0".repeat(64);
    for i in 0..10 {
        fs::write(
            history.join(format!("2099010{i}T000000.000000000Z-{sha}.crt")),
            "old",
        )
        .unwrap();
    }
    fs::write(history.join("operator-notes.crt"), "mine").unwrap();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let source = node.source("signers.pem", a.pem());
    assert!(node.sync(&[&source], &[]).status.success());
    fs::write(source.strip_prefix("file:").unwrap(), b.pem()).unwrap();
    assert!(node.sync(&[&source], &[]).status.success());
    let names: Vec<String> = fs::read_dir(&history)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        names.contains(&"operator-notes.crt".to_string()),
        "{names:?}"
    );
    let saved = names
        .iter()
        .find(|n| n.starts_with("00000001-"))
        .expect("the new entry is kept");
    assert_eq!(fs::read(history.join(saved)).unwrap(), a.pem().as_bytes());
    assert_eq!(
        names.len(),
        11,
        "ten entries and the operator's file: {names:?}"
    );
    assert!(
        !names.iter().any(|n| n.starts_with("20990100")),
        "the oldest goes: {names:?}"
    );

    // A history directory that is a link is not used: nothing behind it is touched.
    let node = Node::new();
    let elsewhere = node.root().join("elsewhere");
    fs::create_dir_all(&elsewhere).unwrap();
    for i in 0..12 {
        fs::write(elsewhere.join(format!("{i:02}-precious.crt")), "keep").unwrap();
    }
    fs::create_dir_all(node.state_dir()).unwrap();
    std::os::unix::fs::symlink(&elsewhere, node.state_dir().join("history")).unwrap();
    let source = node.source("signers.pem", a.pem());
    assert!(node.sync(&[&source], &[]).status.success());
    fs::write(source.strip_prefix("file:").unwrap(), b.pem()).unwrap();
    let out = node.sync(&[&source], &[]);
    assert!(out.status.success());
    assert!(node.holds(b.pem()));
    assert!(stderr(&out).contains("symbolic link"), "{}", stderr(&out));
    assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 12);
}

// 10. Records that could not be written are retried, and counted.

#[test]
fn managed_files_catches_up_after_the_state_directory_was_briefly_unwritable() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let source = node.source("signers.pem", a.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(a.pem()));
    let managed = node.state_dir().join("managed-files.json");
    let records = |pem: &str| {
        let sha = hex_sha256(pem.as_bytes());
        fs::read_to_string(&managed).is_ok_and(|m| m.contains(&sha))
    };
    wait_until(2 * SECOND, || records(&a.pem()));
    let chattr = |flag: &str| {
        let ok = Command::new("chattr")
            .arg(flag)
            .arg(node.state_dir())
            .status()
            .unwrap();
        assert!(ok.success(), "chattr {flag}");
    };
    chattr("+i");
    fs::write(source.strip_prefix("file:").unwrap(), b.pem()).unwrap();
    wait_until(2 * SECOND, || node.holds(b.pem()));
    agent.wait_listening();
    wait_until(3 * SECOND, || {
        agent
            .metric("kubelet_ca_state_errors_total{record=\"managed_files\"}")
            .is_some_and(|v| v >= 1.0)
    });
    chattr("-i");
    wait_until(10 * SECOND, || records(&b.pem()));
}

fn hex_sha256(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

// 11. Text from outside is escaped wherever it leaves the process.

#[test]
fn control_characters_from_certificates_and_file_names_are_escaped_everywhere() {
    let node = Node::new();
    let evil = "evil\u{1b}[31m\u{7}\nINFO forged line";
    let signer = Signer::new(evil, Algorithm::P256);
    let dir = node.root().join("signers");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("good.crt"), signer.pem()).unwrap();
    let spec = format!("dir:{}", dir.display());
    let raw = |text: &str| {
        text.contains('\u{1b}') || text.contains('\u{7}') || text.contains("\nINFO forged")
    };

    let out = node.sync(&[&spec], &["--dry-run"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        !raw(&stdout(&out)) && stdout(&out).contains("evil\\u{1b}[31m"),
        "{}",
        stdout(&out)
    );
    assert!(node.sync(&[&spec], &[]).status.success());
    let out = Command::new(agent_bin())
        .arg("inspect")
        .arg(node.bundle())
        .output()
        .unwrap();
    assert!(
        !raw(&stdout(&out)) && stdout(&out).contains("evil\\u{1b}"),
        "{}",
        stdout(&out)
    );

    // A member whose name carries controls, with content that gets the source rejected,
    // so that its name reaches the log and the health page.
    fs::write(
        dir.join("bad\u{1b}]0;pwned\u{7}\nINFO forged.crt"),
        signer.key_pem(),
    )
    .unwrap();
    let agent = Agent::start(&node, &[&spec], &[]);
    agent.wait_listening();
    wait_until(5 * SECOND, || {
        verbose(&agent).contains("private_key") || verbose(&agent).contains("PRIVATE KEY")
    });
    let page = verbose(&agent);
    assert!(
        !raw(&page) && page.contains("bad\\u{1b}]0;pwned\\u{7}\\u{a}INFO forged.crt"),
        "{page}"
    );
    // The text log escapes them too (ESC and BEL as \x1b and \x07 by the formatter, any
    // control left by the agent's own writer).
    let log = agent.log();
    assert!(!raw(&log), "{log}");
    assert!(
        log.contains("bad\\x1b]0;pwned\\x07\\u{a}INFO forged.crt"),
        "{log}"
    );
}

// 12. A file source written in place is read once the writer is done.

#[test]
fn a_slow_in_place_writer_never_has_its_half_written_file_read() {
    let node = Node::new();
    let (a, b, c) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
        Signer::new("c", Algorithm::P256),
    );
    let source = node.source("signers.pem", a.pem());
    let path = source.strip_prefix("file:").unwrap().to_string();
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(a.pem()));
    let (half, rest) = (b.pem(), c.pem());
    let both = half.clone() + &rest;
    let writer = std::thread::spawn(move || {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.write_all(half.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(150));
        file.write_all(rest.as_bytes()).unwrap();
    });
    let mut seen_half = false;
    let deadline = Instant::now() + 3 * SECOND;
    while Instant::now() < deadline && !node.holds(&both) {
        seen_half |= node.holds(b.pem());
        std::thread::sleep(Duration::from_millis(2));
    }
    writer.join().unwrap();
    assert!(!seen_half, "the half-written source reached the bundle");
    assert!(node.holds(&both));
    agent.wait_listening();
    agent.wait_metric(SECOND, "kubelet_ca_writes_total{", 2.0);
}

// 13. Hooks: one at a time, with a timeout, none left behind.

/// Processes whose command line is exactly `argv` (the agent's own command line holds the
/// hook's text too, so a substring would match it).
fn processes_running(argv: &[&str]) -> usize {
    let wanted: Vec<u8> = argv.iter().flat_map(|a| a.bytes().chain([0])).collect();
    fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| fs::read(e.ok()?.path().join("cmdline")).ok())
        .filter(|cmdline| *cmdline == wanted)
        .count()
}

#[test]
fn hooks_run_one_at_a_time_time_out_and_do_not_outlive_the_agent() {
    let node = Node::new();
    let signers: Vec<Signer> = (0..8)
        .map(|i| Signer::new(&format!("s{i}"), Algorithm::P256))
        .collect();
    let source = node.source("signers.pem", signers[0].pem());
    let path = source.strip_prefix("file:").unwrap().to_string();
    // In the state directory: a hook runs inside the agent's confinement.
    let log = node.state_dir().join("hooks.log");
    // Each run notes its start and end; a run that overlaps another shows as start, start.
    let hook = format!(
        "sh -c 'echo start >> {log}; sleep 0.4; echo end >> {log}'",
        log = log.display()
    );
    let agent = Agent::start(&node, &[&source], &["--exec-on-change", &hook]);
    wait_until(5 * SECOND, || node.holds(signers[0].pem()));
    for signer in &signers[1..] {
        fs::write(&path, signer.pem()).unwrap();
        std::thread::sleep(Duration::from_millis(60));
    }
    wait_until(2 * SECOND, || node.holds(signers[7].pem()));
    std::thread::sleep(Duration::from_millis(1500));
    let lines = fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = lines.lines().collect();
    assert!(
        lines.chunks(2).all(|pair| pair == ["start", "end"]),
        "runs overlapped: {lines:?}"
    );
    assert!(
        lines.len() / 2 <= 4,
        "8 replaces in 0.5 s folded into a few runs: {lines:?}"
    );
    drop(agent);

    // A hook that never ends is killed at its timeout, with what it started.
    let seconds = format!("{}.{}", 500 + std::process::id() % 100, std::process::id());
    let marker = ["sleep", seconds.as_str()];
    let hook = format!("sh -c 'sleep {seconds}; true'");
    let node = Node::new();
    let source = node.source("signers.pem", signers[0].pem());
    let path = source.strip_prefix("file:").unwrap().to_string();
    let mut agent = Agent::start(
        &node,
        &[&source],
        &["--exec-on-change", &hook, "--exec-on-change-timeout", "1s"],
    );
    wait_until(5 * SECOND, || node.holds(signers[0].pem()));
    wait_until(2 * SECOND, || processes_running(&marker) > 0);
    wait_until(5 * SECOND, || processes_running(&marker) == 0);
    agent.wait_listening();
    agent.wait_metric(SECOND, "kubelet_ca_exec_on_change_failures_total", 1.0);
    // One still running when the agent stops goes with it.
    fs::write(&path, signers[1].pem()).unwrap();
    wait_until(2 * SECOND, || processes_running(&marker) > 0);
    assert!(agent.terminate().success());
    assert!(
        eventually(3 * SECOND, || processes_running(&marker) == 0),
        "the hook outlived the agent"
    );
}

// 14. Readiness follows certificate boundaries, and names what is at the path.

#[test]
fn readiness_turns_when_the_last_certificate_expires_with_no_other_event() {
    // The adopted file stands while the only source is rejected (and so silent: nothing
    // else happens): its certificates' boundaries count as much as the sources'.
    let node = Node::new();
    let brief = Signer::valid_between("brief", Algorithm::P256, Span::hours(-1), Span::seconds(3));
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), brief.pem()).unwrap();
    let source = node.source("signers.pem", brief.key_pem());
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    assert_eq!(agent.get("/readyz").map(|(c, _)| c), Some(200));
    wait_until(6 * SECOND, || {
        agent.get("/readyz").map(|(c, _)| c) == Some(503)
    });
    let report = verbose(&agent);
    assert!(
        report.contains("[-]bundle-valid failed: no certificate in the file is valid now"),
        "{report}"
    );
    assert_eq!(agent.metric("x509_cert_expired{"), Some(1.0));
    // With nothing valid to restore, a deleted file is not brought back expired.
    fs::remove_file(node.bundle()).unwrap();
    std::thread::sleep(SECOND);
    assert!(!node.bundle().exists());
}

#[test]
fn a_directory_at_the_bundle_path_is_named_as_such() {
    let node = Node::new();
    let source = node.source("signers.pem", pki::bundle_of(1, "ca"));
    fs::create_dir_all(node.bundle()).unwrap();
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    wait_until(2 * SECOND, || {
        verbose(&agent).contains("is a directory, not a regular file")
    });
    assert_eq!(agent.get("/readyz").map(|(c, _)| c), Some(503));
    assert_eq!(agent.get("/livez").map(|(c, _)| c), Some(200));
    assert!(eventually(SECOND, || !verbose(&agent).contains("does not exist")));
}
