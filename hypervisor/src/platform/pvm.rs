//! PVM: detection through its identification MSR, and the VIF page.

use super::{Platform, PlatformError};
use crate::guest::abi::{FLAG_PVM, VIF_GPA};
use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::VcpuFd;

/// Reads "PVM" on a PVM host; absent on ordinary KVM.
const MSR_PVM_ID: u32 = 0x4b56_4d11;
const PVM_ID: u64 = 0x004d_5650;
/// Guest-physical address of the VIF page, with the mandatory enable bit.
const MSR_PVM_VIF: u32 = 0x4b56_4d10;
const VIF_ENABLE: u64 = 0x400;

/// Whether `vcpu` belongs to a PVM host.
pub fn is_pvm(vcpu: &VcpuFd) -> bool {
    let Ok(mut msrs) = Msrs::from_entries(&[kvm_msr_entry {
        index: MSR_PVM_ID,
        ..Default::default()
    }]) else {
        return false;
    };
    matches!(vcpu.get_msrs(&mut msrs), Ok(1)) && msrs.as_slice()[0].data == PVM_ID
}

/// The PVM host.
pub struct Pvm;

impl Platform for Pvm {
    fn name(&self) -> &'static str {
        "pvm"
    }

    fn boot_flags(&self) -> u32 {
        FLAG_PVM
    }

    fn configure_vcpu(&self, vcpu: &VcpuFd) -> Result<(), PlatformError> {
        let entry = kvm_msr_entry {
            index: MSR_PVM_VIF,
            data: VIF_GPA | VIF_ENABLE,
            ..Default::default()
        };
        let msrs = Msrs::from_entries(&[entry]).expect("one MSR entry");
        match vcpu.set_msrs(&msrs) {
            Ok(1) => Ok(()),
            Ok(_) => Err(PlatformError::Kvm {
                what: "register the PVM VIF page",
                source: kvm_ioctls::Error::new(libc::EINVAL),
            }),
            Err(source) => Err(PlatformError::Kvm {
                what: "register the PVM VIF page",
                source,
            }),
        }
    }
}
