//! Entry point: run the command, turn an error into one line on stderr and an exit code.

use std::io::Write;
use std::process::ExitCode;

use kubelet_ca_agent::error::{Exit, exit_code_for};

fn main() -> ExitCode {
    match kubelet_ca_agent::run() {
        Ok(exit) => ExitCode::from(exit as u8),
        Err(error) => {
            if let Some(clap_error) = error.downcast_ref::<clap::Error>() {
                let _ = clap_error.print();
                return ExitCode::from(Exit::Usage as u8);
            }
            let line = format!("{error:#}");
            // A closed stderr loses the line; the exit code still says it.
            let _ = writeln!(
                std::io::stderr(),
                "kubelet-ca-agent: error: {}",
                kubelet_ca_agent::text::escape(&line)
            );
            ExitCode::from(exit_code_for(&error) as u8)
        }
    }
}
