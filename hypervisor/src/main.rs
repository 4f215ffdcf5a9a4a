//! densevm: thousands of tiny web-server microVMs on /dev/kvm, spread over
//! worker processes (cells) that share one pager. See hypervisor/README.md.

mod cell;
mod config;
mod devices;
mod guest;
mod holder;
mod link;
mod log;
#[cfg(test)]
mod module_graph;
mod parent;
mod platform;
mod scheduling;
mod vstate;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "densevm",
    version,
    about = "Thousands of tiny web-server microVMs on KVM, in cells that share one pager"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot N VMs and serve HTTP on their loopback addresses until SIGTERM.
    Serve(Box<config::ServeArgs>),
    /// Print, as JSON, the facts a controller needs about a configuration
    /// (the same flags as `serve`): guest layout, block limits, policies,
    /// swap sizing and the disk models' parameters. Starts nothing.
    Describe(Box<parent::describe::DescribeArgs>),
    /// A worker process of `serve` (started by it; its stdin is the link).
    #[command(hide = true)]
    Cell,
}

/// Keeps a cell's allocator, and so its holders' (forked from it), from
/// changing memory protections.
///
/// glibc grows a thread's malloc arena with mprotect; once a holder's VMs
/// have MMU notifiers on its process, every mprotect visits all of them. One
/// brk-grown arena that is never trimmed avoids that. The parent holds no
/// VMs: it keeps glibc's defaults, and trims what teardown freed
/// (`parent::heap_trim`).
fn tame_allocator() {
    // SAFETY: mallopt only tunes the allocator; called before other threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                e.exit();
            }
            let message = e.to_string();
            let first = message
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("bad arguments");
            crate::log!("densevm: {}", first.trim_start_matches("error: "));
            std::process::exit(2);
        }
    };
    let code = match cli.command {
        Command::Serve(args) => parent::serve::run(*args),
        Command::Describe(args) => parent::describe::run(*args),
        Command::Cell => {
            tame_allocator();
            cell::run()
        }
    };
    std::process::exit(code);
}
