//! kubelet-ca-agent keeps a node's kubelet client-CA bundle correct. The data flows
//! sources -> bundle -> writer: `source` reads signer certificates, `bundle` (pure) parses,
//! validates, merges and renders them, and `writer` replaces the managed file atomically.
//! `commands` wires them for each subcommand.

pub mod bundle;
pub mod cli;
pub mod commands;
pub mod credentials;
pub mod daemon;
pub mod error;
pub mod exec;
pub mod files;
pub mod fsutil;
pub mod logging;
pub mod metrics;
pub mod publish;
pub mod server;
pub mod source;
pub mod state;
pub mod status;
pub mod systemd;
pub mod target;
pub mod text;
pub mod writer;

use clap::Parser;

use cli::{Cli, Command};
use error::Exit;

/// Parses the command line and runs the command.
pub fn run() -> anyhow::Result<Exit> {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version are not errors: print them and succeed.
        Err(e) if !e.use_stderr() => {
            // A reader that went away (`--help | head`) is not an error worth reporting.
            let _ = e.print();
            return Ok(Exit::Success);
        }
        Err(e) => return Err(e.into()),
    };
    logging::init(cli.log.log_format, &cli.log.log_level)?;
    match cli.command {
        Command::Run(mut args) => {
            args.server.default_node_name();
            daemon::run(*args)
        }
        Command::Publish(mut args) => {
            args.server.default_node_name();
            publish::run(*args)
        }
        Command::Sync(args) => commands::sync::run(args),
        Command::Inspect(args) => commands::inspect::run(args),
        Command::Drift(command) => commands::drift::run(command),
        Command::Version => commands::version(),
    }
}
