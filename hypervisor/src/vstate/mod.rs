//! KVM objects: the VM (memory slots, interrupt controller, irqfd and
//! ioeventfd wiring) and its vCPU thread.

pub mod stats;
pub mod vcpu;
pub mod vm;
