//! What differs between the hosts densevm runs on, behind one small trait.
//!
//! Ordinary KVM (VMX/SVM) runs the guest as it is. PVM, the shadow-paging
//! KVM of this project's machines, runs guest code natively only when a
//! virtual interrupt-flag page is registered; the guest must then use that
//! page instead of `sti`.

mod pvm;
mod standard;

use kvm_ioctls::{Kvm, VcpuFd};

/// Why host-specific set-up failed.
#[derive(Debug, thiserror::Error)]
pub enum PlatformError {
    /// A KVM call failed.
    #[error("{what}: {source}")]
    Kvm {
        /// What was being done.
        what: &'static str,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
}

/// Host-specific parts of setting up a vCPU.
pub trait Platform: Send + Sync {
    /// Short name for stats and the ready line.
    fn name(&self) -> &'static str;
    /// `abi::FLAG_*` bits the guest must be booted with on this host.
    fn boot_flags(&self) -> u32;
    /// Host-specific vCPU set-up, after the architectural state is loaded.
    fn configure_vcpu(&self, vcpu: &VcpuFd) -> Result<(), PlatformError>;
}

/// Probes the host with a throw-away VM and returns its platform.
pub fn detect(kvm: &Kvm) -> Result<Box<dyn Platform>, PlatformError> {
    let vm = kvm.create_vm().map_err(|source| PlatformError::Kvm {
        what: "create a probe VM",
        source,
    })?;
    let vcpu = vm.create_vcpu(0).map_err(|source| PlatformError::Kvm {
        what: "create a probe vCPU",
        source,
    })?;
    if pvm::is_pvm(&vcpu) {
        Ok(Box::new(pvm::Pvm))
    } else {
        Ok(Box::new(standard::StandardKvm))
    }
}
