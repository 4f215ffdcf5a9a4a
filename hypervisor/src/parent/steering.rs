//! Address steering: every VM address reaches its cell's one listening
//! socket, so no VM needs a socket of its own (a socket per VM is a file,
//! an inode and a few KiB of kernel memory, awake or asleep).
//!
//! A BPF sk_lookup program (`bpf/steer.bpf.c`, compiled by `build.rs`)
//! runs before the kernel's own socket lookup for each new TCP connection
//! in this network namespace. For an address in its map on the VMs' port it
//! hands the connection to the socket of the cell that holds the VM, as
//! Cloudflare's tubular does for whole prefixes. The parent loads and
//! attaches the program and alone holds its maps; a cell only gives its
//! socket at its handshake. Dropping [`Steering`] detaches the program.
//!
//! Why not the parent accepting and handing each connection to its cell:
//! that puts a second process and an SCM_RIGHTS message on every
//! connection's path, where this puts one map lookup (measured in
//! `hypervisor/README.md`, "One socket per cell").

use aya::maps::{HashMap as BpfHashMap, MapData, MapError, SockMap};
use aya::programs::{ProgramError, SkLookup};
use aya::{Ebpf, EbpfError, EbpfLoader};
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;

/// The compiled program.
const PROGRAM: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/steer.bpf.o"));

/// Why steering could not be set up or changed.
#[derive(Debug, thiserror::Error)]
pub enum SteeringError {
    /// The program or its maps could not be loaded.
    #[error("load the address-steering BPF program: {0}")]
    Load(#[from] EbpfError),
    /// The program could not be verified or attached.
    #[error("attach the address-steering BPF program (sk_lookup, Linux 5.9+, CAP_BPF and CAP_NET_ADMIN): {0}")]
    Attach(#[from] ProgramError),
    /// The network namespace could not be opened.
    #[error("network namespace: {0}")]
    Netns(std::io::Error),
    /// A map update failed.
    #[error("address-steering map: {0}")]
    Map(#[from] MapError),
    /// The object lacks a part this module expects (a build mismatch).
    #[error("address-steering program has no {0}")]
    Missing(&'static str),
}

/// The attached program and its maps.
pub struct Steering {
    vm_cells: BpfHashMap<MapData, u32, u32>,
    cell_sockets: SockMap<MapData>,
    // Declared last: the maps go before the program detaches.
    _ebpf: Ebpf,
}

impl Steering {
    /// Loads the program for VMs serving on `port`, with room for `vms`
    /// addresses and `cells` cell sockets, and attaches it to this
    /// process's network namespace.
    pub fn attach(port: u16, vms: u32, cells: u32) -> Result<Self, SteeringError> {
        let mut ebpf = EbpfLoader::new()
            .override_global("vm_port", &(port as u32), true)
            .map_max_entries("vm_cells", vms.max(1))
            .map_max_entries("cell_sockets", cells.max(1))
            .load(PROGRAM)?;
        let program: &mut SkLookup = ebpf
            .program_mut("steer")
            .ok_or(SteeringError::Missing("program steer"))?
            .try_into()?;
        program.load()?;
        let netns = std::fs::File::open("/proc/self/ns/net").map_err(SteeringError::Netns)?;
        program.attach(netns)?;
        let vm_cells = ebpf
            .take_map("vm_cells")
            .ok_or(SteeringError::Missing("map vm_cells"))?
            .try_into()?;
        let cell_sockets = ebpf
            .take_map("cell_sockets")
            .ok_or(SteeringError::Missing("map cell_sockets"))?
            .try_into()?;
        Ok(Steering {
            vm_cells,
            cell_sockets,
            _ebpf: ebpf,
        })
    }

    /// Steers connections for cell `cell` to `listener`, a listening TCP
    /// socket. The map holds the socket itself, not the descriptor: the
    /// caller may close its copy, and the entry goes when the cell's does.
    pub fn add_cell(&mut self, cell: u32, listener: &impl AsRawFd) -> Result<(), SteeringError> {
        Ok(self.cell_sockets.set(cell, listener, 0)?)
    }

    /// Steers connections to `addr` to cell `cell`.
    pub fn route(&mut self, addr: Ipv4Addr, cell: u32) -> Result<(), SteeringError> {
        Ok(self.vm_cells.insert(map_key(addr), cell, 0)?)
    }

    /// Stops steering `addr`: the kernel's own lookup handles it again.
    pub fn unroute(&mut self, addr: Ipv4Addr) {
        // Absent already (never routed): nothing to undo.
        let _ = self.vm_cells.remove(&map_key(addr));
    }
}

/// The program reads the address as the packet carries it (network order).
fn map_key(addr: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(addr.octets())
}
