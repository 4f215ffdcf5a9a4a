//! pagesim: replays a request trace (recorded by densevm, or synthetic with
//! Zipf popularity) through a pager policy and a disk model, and prints the
//! hit ratio, swap traffic and predicted throughput. The options and the
//! replay live in [`paging_policy::replay`], shared with the Python
//! extension.
//!
//! Exit status: 0 on success, 2 for bad flags or configuration (one line on
//! stderr), 1 for a failure during the simulation.

use std::process::ExitCode;

use clap::Parser;

use paging_policy::replay::{PagesimArgs, Replay};

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("pagesim: error: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args = match PagesimArgs::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            let text = e.to_string();
            let first = text.lines().next().unwrap_or("bad arguments");
            return usage_error(first.trim_start_matches("error: "));
        }
    };
    // Everything up to the first request is configuration (exit 2); a
    // failure while replaying is a run failure (exit 1).
    let replay = match Replay::new(&args, None) {
        Ok(r) => r,
        Err(e) => return usage_error(&e.to_string()),
    };
    match replay.run() {
        Ok(outcome) if args.json => {
            println!("{}", outcome.to_json());
            ExitCode::SUCCESS
        }
        Ok(outcome) => {
            println!("{}", outcome.to_text());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("pagesim: error: {e}");
            ExitCode::from(1)
        }
    }
}
