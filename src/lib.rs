//! kubelet-ca-agent keeps a node's kubelet client-CA bundle correct. The data flows
//! sources -> bundle -> writer: `source` reads signer certificates, `bundle` (pure) parses,
//! validates, merges and renders them, and `writer` replaces the managed file atomically.
//! `commands` wires them for each subcommand.

pub mod bundle;
pub mod cli;
pub mod commands;
pub mod config;
pub mod confine;
pub mod credentials;
pub mod daemon;
pub mod error;
pub mod exec;
pub mod files;
pub mod fleet;
pub mod follow;
pub mod fsutil;
pub mod kubeconfig;
pub mod kubelet_config;
pub mod kubelet_restart;
pub mod logging;
pub mod metrics;
pub mod publish;
pub mod registry;
pub mod running;
pub mod runtime;
pub mod server;
pub mod source;
pub mod state;
pub mod status;
pub mod systemd;
pub mod targets;
#[cfg(test)]
mod testlog;
pub mod text;

pub mod writer;

use std::io::Write;

use clap::FromArgMatches;

use cli::environment::{self, EnvFlag};
use cli::{Cli, Command};
use error::{Exit, UsageError};

/// Parses the command line and runs the command.
pub fn run() -> anyhow::Result<Exit> {
    let cli = match parse() {
        Ok(cli) => cli,
        // --help and --version are not errors: print them and succeed.
        Err(e)
            if e.downcast_ref::<clap::Error>()
                .is_some_and(|e| !e.use_stderr()) =>
        {
            // A reader that went away (`--help | head`) is not an error worth reporting.
            if let Some(e) = e.downcast_ref::<clap::Error>() {
                let _ = e.print();
            }
            return Ok(Exit::Success);
        }
        Err(e) => return Err(e),
    };
    logging::init(cli.log.log_format.config(), &cli.log.log_level)?;
    match cli.command {
        Command::Run(args) => daemon::run(args.config()?),
        Command::Publish(args) => publish::run(args.config()?),
        Command::Sync(args) => commands::sync::run(args.config()?),
        Command::Inspect(args) => commands::inspect::run(args),
        Command::Drift(command) => commands::drift::run(command),
        Command::Rollout(cli::RolloutCommand::Status(args)) => {
            commands::rollout::run(args.config())
        }
        Command::Rollout(cli::RolloutCommand::Wait(args)) => commands::rollout::run(args.config()),
        Command::Version => commands::version(),
    }
}

/// The command line and the environment, as clap reads them, with what clap cannot say:
/// a warning for each `KUBELET_CA_AGENT_*` variable that no flag reads (first, before any
/// other line), comma-separated lists tidied (`a, b,` is `a,b`), and a value refused from
/// the environment reported under its variable.
fn parse() -> anyhow::Result<Cli> {
    let plugin = std::env::args_os()
        .next()
        .is_some_and(|argv0| cli::is_kubectl_plugin(&argv0));
    let command = cli::command(plugin);
    let flags = environment::env_flags(&command);
    let mut stderr = std::io::stderr().lock();
    for line in environment::unknown_variables(std::env::vars_os(), &flags) {
        // A closed stderr loses the warning, nothing more.
        let _ = writeln!(stderr, "kubelet-ca-agent: warning: {line}");
    }
    drop(stderr);
    let as_set = tidy_list_variables(&flags);
    let args = environment::tidy_args(std::env::args_os().collect(), &flags);
    // clap reads a flag's variable when the command is built: build it again, now that
    // the lists are tidy.
    drop(command);
    let parsed = cli::command(plugin)
        .try_get_matches_from(&args)
        .and_then(|matches| Cli::from_arg_matches(&matches));
    parsed.map_err(|error| {
        let env = |var: &str| {
            as_set
                .iter()
                .find(|(name, _)| name == var)
                .map(|(_, value)| value.clone())
                .or_else(|| std::env::var(var).ok())
        };
        match environment::explain(&error, &args, &flags, env) {
            Some(line) => UsageError(line).into(),
            None => error.into(),
        }
    })
}

/// Tidies the list variables (`KUBELET_CA_AGENT_SOURCE=a, b,` is read as `a,b`), and
/// returns those it changed, as they were set, for messages.
fn tidy_list_variables(flags: &[EnvFlag]) -> Vec<(String, String)> {
    let mut as_set = Vec::new();
    for flag in flags.iter().filter(|f| f.list) {
        let Ok(value) = std::env::var(&flag.var) else {
            continue;
        };
        if let Some(tidy) = environment::tidy_list(&value) {
            // SAFETY: `run` is the process's first act in `main`: no other thread exists
            // yet that could read the environment at the same time.
            unsafe { std::env::set_var(&flag.var, tidy) };
            as_set.push((flag.var.clone(), value));
        }
    }
    as_set
}
