//! The link between densevm's parent process and its cells: one JSON object
//! per line on a Unix stream socket (the cell's standard input), plus one
//! message carrying descriptors.
//!
//! 1. parent -> cell: [`CellConfig`].
//! 2. cell -> parent: [`Hello`], with a userfaultfd for each of the cell's
//!    holders, then its one guest-RAM memfd and its listening socket
//!    attached (SCM_RIGHTS).
//! 3. parent -> cell: [`ToCell::Go`] once the pager holds the cell's memory
//!    and knows its VMs; the cell boots them.
//! 4. From then on the parent sends [`ToCell`] requests, one at a time, each
//!    in a [`Request`] with an id, and each answered by one
//!    [`FromCell::Reply`] echoing that id; the cell also sends events
//!    ([`FromCell::Booted`], [`FromCell::Access`], [`FromCell::Stopped`])
//!    whenever they happen, and [`FromCell::Failed`] if it cannot start.
//!
//! The parent trusts none of it: a line that does not parse, is too long,
//! answers no request in flight (or another one), reports counts or VMs
//! that are not the cell's, or a `Failed` after the handshake ends that
//! cell (it is killed, its VMs crashed), never the parent. Every wait has a
//! deadline, in [`deadline`].

use crate::config::CellSettings;
use crate::link::idle_profile::IdleProfile;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::time::Duration;

/// The deadline budget of the links, in one place: parent > cell > holder.
/// Each side waits for the one below it for less than it is itself waited
/// for, so a stuck holder is given up by its cell before the parent gives up
/// the cell; a cell that misses the parent's deadline is killed (its VMs
/// crashed) rather than blocking the parent.
pub mod deadline {
    use super::Duration;

    /// The parent waits this long for a cell's hello (its holders started).
    pub const CELL_HELLO: Duration = Duration::from_secs(60);
    /// A cell waits this long for each holder's start (its userfaultfd).
    pub const HOLDER_START: Duration = Duration::from_secs(45);
    /// The parent waits this long for the reply to `stats`, `list`,
    /// `destroy` or `crash` (all cells asked at once share it).
    pub const CELL_REPLY: Duration = Duration::from_secs(10);
    /// A cell waits this long for a holder's answer to anything but a
    /// build (stop a VM, say): well within [`CELL_REPLY`].
    pub const HOLDER_REPLY: Duration = Duration::from_secs(5);
    /// The parent waits this long for a cell to answer `create` (a new
    /// cell: its hello, then its first reply).
    pub const CELL_CREATE: Duration = Duration::from_secs(60);
    /// A cell waits this long, in all, for its holders to build the VMs of
    /// one `create`: within [`CELL_CREATE`].
    pub const HOLDER_BUILD: Duration = Duration::from_secs(45);

    // The budget runs parent > cell > holder, checked when compiled.
    const _: () = assert!(HOLDER_START.as_secs() < CELL_HELLO.as_secs());
    const _: () = assert!(HOLDER_REPLY.as_secs() < CELL_REPLY.as_secs());
    const _: () = assert!(HOLDER_BUILD.as_secs() < CELL_CREATE.as_secs());
}

/// A request from the parent with the id its reply echoes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// Unique on this link, increasing; the handshake's [`ToCell::Go`] is 0.
    pub id: u64,
    /// What is asked.
    pub req: ToCell,
}

/// Longest line either side accepts on a cell link (a full stats reply of a
/// cell's VMs stays far below it).
pub const MAX_LINK_LINE: usize = 64 << 20;

/// What a cell runs: the settings every cell shares (derived from the
/// flags by the parent), and its share of the VMs.
#[derive(Debug, Serialize, Deserialize)]
pub struct CellConfig {
    /// The settings of every cell.
    pub settings: CellSettings,
    /// Index of the cell.
    pub cell: u32,
    /// The parent's pid: a cell whose parent is gone exits.
    pub parent_pid: u32,
    /// Id of the cell's first VM; its VMs have consecutive ids.
    pub first_id: u32,
    /// VMs to boot now.
    pub count: u32,
    /// VMs the cell can ever hold (slots of its guest-RAM memfd).
    pub capacity: u32,
}

/// The cell's first message; its descriptors travel with it: a
/// userfaultfd per entry of `spaces`, in that order, then the guest-RAM
/// memfd whose consecutive slices the spaces are, then the cell's socket.
#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    /// The cell's pid.
    pub pid: u32,
    /// VMs per holder: the cell's slot `i` is in `spaces[i / holder_vms]`.
    pub holder_vms: u32,
    /// Each holder's guest RAM.
    pub spaces: Vec<Space>,
    /// "pvm" or "kvm".
    pub platform: String,
}

/// One holder's guest RAM, mapped at the same address in the holder and
/// in the cell's front: the slice of the cell's memfd after the spaces
/// before it.
#[derive(Debug, Serialize, Deserialize)]
pub struct Space {
    /// Address of the mapping.
    pub base: usize,
    /// Its length (its slots x RAM per VM).
    pub len: usize,
}

/// A request from the parent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum ToCell {
    /// The pager is ready: boot the VMs.
    Go,
    /// Totals, and with `per_vm` each VM's figures.
    Stats {
        /// Include the per-VM list.
        per_vm: bool,
    },
    /// Each VM's address and state.
    List,
    /// Boot VMs `first..first + count` (the parent registered their RAM).
    Create {
        /// First id.
        first: u32,
        /// How many.
        count: u32,
    },
    /// Stop a VM.
    Destroy {
        /// Its id.
        vm: u32,
    },
    /// Stop a VM the parent cannot serve (the pager failed on its memory):
    /// it is listed as crashed, with `reason`.
    Fail {
        /// Its id.
        vm: u32,
        /// Why, one line.
        reason: String,
    },
    /// Make a guest fault (fault-containment tests).
    Crash {
        /// Its id.
        vm: u32,
        /// Triple fault rather than an invalid instruction.
        triple: bool,
    },
    /// Stop every VM and exit.
    Shutdown,
    /// A notice, not answered, to a cell's [`FromCell::Idle`]: its VMs last
    /// in use at or before CLOCK_MONOTONIC millisecond `ms` may sleep for
    /// `--max-live` (0: none need to), down to its floor.
    SleepBefore {
        /// The cut, over every cell's profile.
        ms: u64,
    },
    /// A notice, not answered, with clone boot: the pager saved the image's
    /// template (`ready`), so VMs created asleep start as its clones, or it
    /// could not, so they boot each. Until it comes no VM takes a
    /// connection.
    Template {
        /// The template was saved.
        ready: bool,
    },
    /// A notice, not answered: the restarted holder `holder` of
    /// [`FromCell::HolderStarted`] is attached to the pager (`error`: why
    /// not); its VMs may run.
    HolderAttached {
        /// Its index in the cell.
        holder: u32,
        /// Why the pager refused it.
        error: Option<String>,
    },
}

/// A message from a cell.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum FromCell {
    /// Every VM of the first boot answers or has died.
    Booted {
        /// VMs serving.
        ready: u32,
        /// VMs that died while booting.
        failed: u32,
    },
    /// Requests served since the last report: (VM id, count).
    Access {
        /// Per VM.
        counts: Vec<(u32, u64)>,
    },
    /// A VM stopped for good: the pager may release it.
    Stopped {
        /// Its id.
        vm: u32,
    },
    /// VM `vm` no longer has a vCPU (hibernated): the pager may move all
    /// its memory to swap.
    Hibernated {
        /// Its id.
        vm: u32,
    },
    /// Hibernated VM `vm` is being woken: the pager may bring back what
    /// it had resident while its holder makes its vCPU.
    Waking {
        /// Its id.
        vm: u32,
    },
    /// With `--max-live`, at each look for VMs to hibernate: how many of
    /// its VMs are awake and when its unused ones were last in use. The
    /// parent answers with [`ToCell::SleepBefore`].
    Idle {
        /// Its awake VMs.
        profile: IdleProfile,
    },
    /// Holder `holder` left, every VM of it asleep, and its process is
    /// gone: the parent's pager drops its userfaultfd. A
    /// [`FromCell::HolderStarted`] gives it a new one.
    HolderLeft {
        /// Its index in the cell.
        holder: u32,
    },
    /// Holder `holder`, which had left with all its VMs asleep, was
    /// started again to wake one: its userfaultfd comes with this line. The
    /// parent attaches it to the pager in place of the old one and answers
    /// with [`ToCell::HolderAttached`].
    HolderStarted {
        /// Its index in the cell.
        holder: u32,
    },
    /// The answer to the request in flight.
    Reply {
        /// The id of the [`Request`] it answers.
        id: u64,
        /// As the control API would answer it.
        reply: Value,
    },
    /// The cell cannot start (sent instead of its hello, or before its
    /// first boot ends); after that the parent takes it as hostile.
    Failed {
        /// One line.
        error: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_events_round_trip() {
        for (id, req) in [
            ToCell::Go,
            ToCell::Stats { per_vm: false },
            ToCell::Create { first: 5, count: 2 },
            ToCell::Fail {
                vm: 3,
                reason: "no swap".into(),
            },
            ToCell::Shutdown,
        ]
        .into_iter()
        .enumerate()
        {
            let request = Request { id: id as u64, req };
            let line = serde_json::to_string(&request).unwrap();
            assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), request);
        }
        assert_eq!(
            serde_json::to_string(&Request {
                id: 7,
                req: ToCell::List
            })
            .unwrap(),
            r#"{"id":7,"req":{"cmd":"list"}}"#
        );
        // A reply without its request's id is not a reply.
        assert!(serde_json::from_str::<FromCell>(r#"{"ev":"reply","reply":{}}"#).is_err());
        let line = serde_json::to_string(&FromCell::Access {
            counts: vec![(3, 2)],
        })
        .unwrap();
        assert_eq!(line, r#"{"ev":"access","counts":[[3,2]]}"#);
    }
}
