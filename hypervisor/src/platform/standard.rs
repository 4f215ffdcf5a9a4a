//! Ordinary KVM on VMX or SVM: nothing beyond the architectural state.

use super::{Platform, PlatformError};
use kvm_ioctls::VcpuFd;

/// An ordinary KVM host.
pub struct StandardKvm;

impl Platform for StandardKvm {
    fn name(&self) -> &'static str {
        "kvm"
    }

    fn boot_flags(&self) -> u32 {
        0
    }

    fn configure_vcpu(&self, _vcpu: &VcpuFd) -> Result<(), PlatformError> {
        Ok(())
    }
}
