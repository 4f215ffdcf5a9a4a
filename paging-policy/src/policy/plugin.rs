//! Out-of-tree policies in shared libraries.
//!
//! # ABI (version 1)
//!
//! A plugin exports `scalebench_policy_v1`, a C function returning a pointer
//! to a static [`PolicyVtableV1`]. The host checks `abi_version`, calls
//! `create` with the argument string (what follows the first comma of
//! `--policy lib.so,...`), the block size and the budget in blocks, and then
//! drives the instance through the other entries, which mirror the
//! [`Policy`] trait. Lists are returned through caller-provided buffers with
//! a capacity; every entry returns a status ([`STATUS_OK`], [`STATUS_PANIC`],
//! [`STATUS_OVERFLOW`]).
//!
//! Plugin authors do not write this by hand: implement [`Policy`] and
//! [`PluginPolicyFactory`] and invoke [`export_policy!`](crate::export_policy).
//! The generated entries catch panics inside the plugin, so no unwinding
//! crosses the C boundary.
//!
//! # Containment
//!
//! The host treats a panic, a non-zero status, an overflowing answer, or a
//! victim that is not resident as a fatal policy error: the run stops with a
//! clear message before any guest memory is touched on the policy's say-so.
//! A plugin that corrupts memory or aborts the process cannot be contained
//! in-process; that is the price of running policies without IPC.

use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use super::{BlockId, Policy, SwapLayout, VmId};
use crate::error::PagerError;

/// Version of [`PolicyVtableV1`].
pub const ABI_VERSION: u32 = 1;
/// Name of the exported entry symbol.
pub const ENTRY_SYMBOL: &[u8] = b"scalebench_policy_v1";
/// The call succeeded.
pub const STATUS_OK: i32 = 0;
/// The plugin panicked; it must not be called again.
pub const STATUS_PANIC: i32 = 1;
/// The plugin's answer did not fit the buffer.
pub const STATUS_OVERFLOW: i32 = 2;

/// One victim in a `choose_victims` answer.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RawVictim {
    /// VM id.
    pub vm: u32,
    /// Block index within the VM.
    pub block: u32,
}

/// The C vtable a plugin exports. `state` is the pointer `create` returned.
#[repr(C)]
pub struct PolicyVtableV1 {
    /// Must equal [`ABI_VERSION`].
    pub abi_version: u32,
    /// Creates an instance; null means the arguments were refused.
    pub create: unsafe extern "C" fn(
        args: *const c_char,
        block_bytes: u64,
        budget_blocks: u64,
    ) -> *mut c_void,
    /// Frees an instance.
    pub destroy: unsafe extern "C" fn(state: *mut c_void),
    /// Instance name, NUL-terminated, valid until `destroy`.
    pub name: unsafe extern "C" fn(state: *mut c_void) -> *const c_char,
    /// [`SwapLayout`] as u32 (0 per-VM, 1 log).
    pub layout: unsafe extern "C" fn(state: *mut c_void) -> u32,
    /// See [`Policy::on_vm_registered`].
    pub on_vm_registered: unsafe extern "C" fn(state: *mut c_void, vm: u32, blocks: u32) -> i32,
    /// See [`Policy::on_vm_unregistered`].
    pub on_vm_unregistered: unsafe extern "C" fn(state: *mut c_void, vm: u32) -> i32,
    /// See [`Policy::on_access`].
    pub on_access: unsafe extern "C" fn(state: *mut c_void, vm: u32) -> i32,
    /// See [`Policy::on_fault`]; writes up to `cap` blocks to `out`.
    pub on_fault: unsafe extern "C" fn(
        state: *mut c_void,
        vm: u32,
        block: u32,
        out: *mut u32,
        cap: usize,
        len: *mut usize,
    ) -> i32,
    /// See [`Policy::on_installed`].
    pub on_installed: unsafe extern "C" fn(state: *mut c_void, vm: u32, block: u32) -> i32,
    /// See [`Policy::choose_victims`]; writes up to `cap` victims to `out`.
    pub choose_victims: unsafe extern "C" fn(
        state: *mut c_void,
        need: u32,
        faulting_vm: u32,
        out: *mut RawVictim,
        cap: usize,
        len: *mut usize,
    ) -> i32,
    /// See [`Policy::on_evicted`].
    pub on_evicted: unsafe extern "C" fn(state: *mut c_void, vm: u32, block: u32) -> i32,
}

/// How a plugin's policy is constructed from the `--policy` arguments.
pub trait PluginPolicyFactory: Policy + Sized + 'static {
    /// Builds the policy; `Err` refuses the arguments.
    fn create(args: &str, block_bytes: u64, budget_blocks: u64) -> Result<Self, String>;
}

/// Plugin-side instance: the policy and its name as a C string.
struct Instance<P> {
    policy: P,
    name: CString,
    out: Vec<BlockId>,
    victims: Vec<(VmId, BlockId)>,
}

fn guard(f: impl FnOnce() -> i32) -> i32 {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(STATUS_PANIC)
}

unsafe extern "C" fn shim_create<P: PluginPolicyFactory>(
    args: *const c_char,
    block: u64,
    budget: u64,
) -> *mut c_void {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the host passes a valid NUL-terminated string.
        let args = unsafe { CStr::from_ptr(args) }.to_string_lossy();
        match P::create(&args, block, budget) {
            Ok(policy) => {
                let name = CString::new(policy.name().replace('\0', "")).unwrap_or_default();
                Box::into_raw(Box::new(Instance {
                    policy,
                    name,
                    out: Vec::new(),
                    victims: Vec::new(),
                }))
                .cast()
            }
            Err(e) => {
                eprintln!("policy plugin refused its arguments '{args}': {e}");
                std::ptr::null_mut()
            }
        }
    }))
    .unwrap_or(std::ptr::null_mut())
}

/// # Safety
/// `s` is a pointer returned by `shim_create::<P>`.
unsafe fn inst<'a, P>(s: *mut c_void) -> &'a mut Instance<P> {
    // SAFETY: per the function's contract.
    unsafe { &mut *s.cast::<Instance<P>>() }
}

unsafe extern "C" fn shim_destroy<P: PluginPolicyFactory>(s: *mut c_void) {
    // SAFETY: `s` came from `shim_create::<P>` and is destroyed once.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        drop(unsafe { Box::from_raw(s.cast::<Instance<P>>()) })
    }));
}

unsafe extern "C" fn shim_name<P: PluginPolicyFactory>(s: *mut c_void) -> *const c_char {
    // SAFETY: host contract.
    unsafe { inst::<P>(s) }.name.as_ptr()
}

unsafe extern "C" fn shim_layout<P: PluginPolicyFactory>(s: *mut c_void) -> u32 {
    // SAFETY: host contract.
    catch_unwind(AssertUnwindSafe(|| {
        unsafe { inst::<P>(s) }.policy.layout() as u32
    }))
    .unwrap_or(u32::MAX)
}

unsafe extern "C" fn shim_registered<P: PluginPolicyFactory>(
    s: *mut c_void,
    vm: u32,
    blocks: u32,
) -> i32 {
    // SAFETY: host contract.
    guard(|| {
        unsafe { inst::<P>(s) }.policy.on_vm_registered(vm, blocks);
        STATUS_OK
    })
}

unsafe extern "C" fn shim_unregistered<P: PluginPolicyFactory>(s: *mut c_void, vm: u32) -> i32 {
    // SAFETY: host contract.
    guard(|| {
        unsafe { inst::<P>(s) }.policy.on_vm_unregistered(vm);
        STATUS_OK
    })
}

unsafe extern "C" fn shim_access<P: PluginPolicyFactory>(s: *mut c_void, vm: u32) -> i32 {
    // SAFETY: host contract.
    guard(|| {
        unsafe { inst::<P>(s) }.policy.on_access(vm);
        STATUS_OK
    })
}

unsafe extern "C" fn shim_fault<P: PluginPolicyFactory>(
    s: *mut c_void,
    vm: u32,
    block: u32,
    out: *mut u32,
    cap: usize,
    len: *mut usize,
) -> i32 {
    guard(|| {
        // SAFETY: host contract.
        let i = unsafe { inst::<P>(s) };
        i.out.clear();
        i.policy.on_fault(vm, block, &mut i.out);
        if i.out.len() > cap {
            return STATUS_OVERFLOW;
        }
        // SAFETY: `out` has room for `cap` entries; `len` is writable.
        unsafe {
            std::ptr::copy_nonoverlapping(i.out.as_ptr(), out, i.out.len());
            *len = i.out.len();
        }
        STATUS_OK
    })
}

unsafe extern "C" fn shim_installed<P: PluginPolicyFactory>(
    s: *mut c_void,
    vm: u32,
    block: u32,
) -> i32 {
    // SAFETY: host contract.
    guard(|| {
        unsafe { inst::<P>(s) }.policy.on_installed(vm, block);
        STATUS_OK
    })
}

unsafe extern "C" fn shim_victims<P: PluginPolicyFactory>(
    s: *mut c_void,
    need: u32,
    faulting: u32,
    out: *mut RawVictim,
    cap: usize,
    len: *mut usize,
) -> i32 {
    guard(|| {
        // SAFETY: host contract.
        let i = unsafe { inst::<P>(s) };
        i.victims.clear();
        i.policy.choose_victims(need, faulting, &mut i.victims);
        if i.victims.len() > cap {
            return STATUS_OVERFLOW;
        }
        for (k, &(vm, block)) in i.victims.iter().enumerate() {
            // SAFETY: k < cap.
            unsafe { *out.add(k) = RawVictim { vm, block } };
        }
        // SAFETY: `len` is writable.
        unsafe { *len = i.victims.len() };
        STATUS_OK
    })
}

unsafe extern "C" fn shim_evicted<P: PluginPolicyFactory>(
    s: *mut c_void,
    vm: u32,
    block: u32,
) -> i32 {
    // SAFETY: host contract.
    guard(|| {
        unsafe { inst::<P>(s) }.policy.on_evicted(vm, block);
        STATUS_OK
    })
}

/// The vtable for policy type `P`; used by [`export_policy!`](crate::export_policy).
pub fn vtable<P: PluginPolicyFactory>() -> PolicyVtableV1 {
    PolicyVtableV1 {
        abi_version: ABI_VERSION,
        create: shim_create::<P>,
        destroy: shim_destroy::<P>,
        name: shim_name::<P>,
        layout: shim_layout::<P>,
        on_vm_registered: shim_registered::<P>,
        on_vm_unregistered: shim_unregistered::<P>,
        on_access: shim_access::<P>,
        on_fault: shim_fault::<P>,
        on_installed: shim_installed::<P>,
        choose_victims: shim_victims::<P>,
        on_evicted: shim_evicted::<P>,
    }
}

/// Exports a [`PluginPolicyFactory`] type as a policy plugin (build the
/// crate as a `cdylib`).
///
/// ```ignore
/// paging_policy::export_policy!(MyPolicy);
/// ```
#[macro_export]
macro_rules! export_policy {
    ($ty:ty) => {
        /// Entry point of the policy plugin (ABI version 1).
        #[no_mangle]
        pub extern "C" fn scalebench_policy_v1() -> *const $crate::policy::plugin::PolicyVtableV1 {
            static VTABLE: ::std::sync::OnceLock<$crate::policy::plugin::PolicyVtableV1> =
                ::std::sync::OnceLock::new();
            VTABLE.get_or_init($crate::policy::plugin::vtable::<$ty>)
        }
    };
}

/// Host-side adapter: a loaded plugin instance behind the [`Policy`] trait.
pub struct PluginPolicy {
    // Field order matters: the instance is destroyed (in Drop) before the
    // library is unloaded.
    vt: PolicyVtableV1,
    state: *mut c_void,
    name: String,
    layout: SwapLayout,
    failure: Option<String>,
    out: Vec<u32>,
    victims: Vec<RawVictim>,
    _lib: libloading::Library,
}

// SAFETY: the instance is only used through `&mut self`, i.e. by one thread
// at a time under the pager's bookkeeping lock; the ABI asks plugins not to
// rely on thread-local state.
unsafe impl Send for PluginPolicy {}

/// Most blocks a plugin may name in one answer; a larger answer is nonsense
/// for any realistic budget and is refused rather than allocated.
const MAX_ANSWER: usize = 1 << 20;

/// The path `dlopen` is given for a plugin: `path` itself when it holds a
/// '/', else `./path`. Given a bare name (`x.so`), the dynamic loader would
/// search LD_LIBRARY_PATH, the cache and the system directories, not the
/// current directory, so a library other than the one checked could be
/// loaded; with a '/' it opens exactly that file.
pub fn explicit_path(path: &Path) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    if path.as_os_str().as_bytes().contains(&b'/') {
        path.to_path_buf()
    } else {
        Path::new(".").join(path)
    }
}

impl PluginPolicy {
    /// Loads `path` (through [`explicit_path`]: never searched on the
    /// loader's path), checks the ABI, and creates an instance with `args`.
    pub fn load(
        path: &Path,
        args: &str,
        block_bytes: u64,
        budget_blocks: u64,
    ) -> Result<PluginPolicy, PagerError> {
        let path = &explicit_path(path);
        let fail = |reason: String| PagerError::PluginLoad {
            path: path.to_path_buf(),
            reason,
        };
        if !path.is_file() {
            return Err(PagerError::PluginMissing(path.to_path_buf()));
        }
        // SAFETY: loading a library runs its initialisers; choosing to load
        // a plugin is the user's decision.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| fail(e.to_string()))?;
        // SAFETY: the symbol's type is fixed by the ABI.
        let entry: libloading::Symbol<unsafe extern "C" fn() -> *const PolicyVtableV1> =
            unsafe { lib.get(ENTRY_SYMBOL) }
                .map_err(|_| fail("no scalebench_policy_v1 symbol: not a policy plugin".into()))?;
        // SAFETY: calling the plugin's entry point.
        let vt_ptr = unsafe { entry() };
        if vt_ptr.is_null() {
            return Err(fail("scalebench_policy_v1 returned null".into()));
        }
        // SAFETY: non-null pointer to the plugin's static vtable; read the
        // version field first, which every ABI version places first.
        let version = unsafe { std::ptr::read(vt_ptr.cast::<u32>()) };
        if version != ABI_VERSION {
            return Err(fail(format!(
                "ABI version {version}, this pager speaks {ABI_VERSION}"
            )));
        }
        // SAFETY: version checked; the layout is PolicyVtableV1.
        let vt = unsafe { std::ptr::read(vt_ptr) };
        let cargs = CString::new(args).map_err(|_| fail("arguments contain NUL".into()))?;
        // SAFETY: ABI call with a valid C string.
        let state = unsafe { (vt.create)(cargs.as_ptr(), block_bytes, budget_blocks) };
        if state.is_null() {
            return Err(fail(format!("refused arguments '{args}'")));
        }
        // SAFETY: ABI calls on a live instance.
        let name_ptr = unsafe { (vt.name)(state) };
        let name = if name_ptr.is_null() {
            path.display().to_string()
        } else {
            // SAFETY: NUL-terminated per ABI.
            unsafe { CStr::from_ptr(name_ptr) }
                .to_string_lossy()
                .into_owned()
        };
        // SAFETY: ABI call on a live instance.
        let layout = match unsafe { (vt.layout)(state) } {
            0 => SwapLayout::PerVm,
            1 => SwapLayout::Log,
            other => {
                // SAFETY: destroying the instance we created.
                unsafe { (vt.destroy)(state) };
                return Err(fail(format!("unknown swap layout {other}")));
            }
        };
        Ok(PluginPolicy {
            vt,
            state,
            name,
            layout,
            failure: None,
            out: vec![0; 1024],
            victims: vec![RawVictim::default(); 1024],
            _lib: lib,
        })
    }

    fn check(&mut self, what: &str, status: i32) -> bool {
        match status {
            STATUS_OK => true,
            STATUS_PANIC => {
                self.failure
                    .get_or_insert_with(|| format!("plugin panicked in {what}"));
                false
            }
            STATUS_OVERFLOW => {
                self.failure.get_or_insert_with(|| {
                    format!("plugin returned more than {MAX_ANSWER} entries from {what}")
                });
                false
            }
            s => {
                self.failure.get_or_insert_with(|| {
                    format!("plugin returned unknown status {s} from {what}")
                });
                false
            }
        }
    }

    fn alive(&self) -> bool {
        self.failure.is_none()
    }
}

impl Drop for PluginPolicy {
    fn drop(&mut self) {
        // A plugin that panicked may hold broken state: leak it rather than
        // run its destructor.
        if self.failure.is_none() {
            // SAFETY: live instance, destroyed once, before the library.
            unsafe { (self.vt.destroy)(self.state) };
        }
    }
}

impl Policy for PluginPolicy {
    fn name(&self) -> &str {
        &self.name
    }

    fn layout(&self) -> SwapLayout {
        self.layout
    }

    fn on_vm_registered(&mut self, vm: VmId, blocks: u32) {
        if self.alive() {
            // SAFETY: ABI call on a live instance.
            let s = unsafe { (self.vt.on_vm_registered)(self.state, vm, blocks) };
            self.check("on_vm_registered", s);
        }
    }

    fn on_vm_unregistered(&mut self, vm: VmId) {
        if self.alive() {
            // SAFETY: ABI call on a live instance.
            let s = unsafe { (self.vt.on_vm_unregistered)(self.state, vm) };
            self.check("on_vm_unregistered", s);
        }
    }

    fn on_access(&mut self, vm: VmId) {
        if self.alive() {
            // SAFETY: ABI call on a live instance.
            let s = unsafe { (self.vt.on_access)(self.state, vm) };
            self.check("on_access", s);
        }
    }

    fn on_fault(&mut self, vm: VmId, block: BlockId, prefetch: &mut Vec<BlockId>) {
        if !self.alive() {
            return;
        }
        let mut len = 0usize;
        loop {
            // SAFETY: `out` has `out.len()` writable entries.
            let s = unsafe {
                (self.vt.on_fault)(
                    self.state,
                    vm,
                    block,
                    self.out.as_mut_ptr(),
                    self.out.len(),
                    &mut len,
                )
            };
            // Grow and retry once the plugin says the answer did not fit.
            if s == STATUS_OVERFLOW && self.out.len() < MAX_ANSWER {
                let n = (self.out.len() * 4).min(MAX_ANSWER);
                self.out.resize(n, 0);
                continue;
            }
            if !self.check("on_fault", s) {
                return;
            }
            break;
        }
        if len > self.out.len() {
            self.failure = Some(format!(
                "plugin on_fault reported {len} entries for a buffer of {}",
                self.out.len()
            ));
            return;
        }
        prefetch.extend_from_slice(&self.out[..len]);
    }

    fn on_installed(&mut self, vm: VmId, block: BlockId) {
        if self.alive() {
            // SAFETY: ABI call on a live instance.
            let s = unsafe { (self.vt.on_installed)(self.state, vm, block) };
            self.check("on_installed", s);
        }
    }

    fn choose_victims(&mut self, need: u32, faulting_vm: VmId, victims: &mut Vec<(VmId, BlockId)>) {
        if !self.alive() {
            return;
        }
        let mut len = 0usize;
        loop {
            // SAFETY: `victims` has `victims.len()` writable entries.
            let s = unsafe {
                (self.vt.choose_victims)(
                    self.state,
                    need,
                    faulting_vm,
                    self.victims.as_mut_ptr(),
                    self.victims.len(),
                    &mut len,
                )
            };
            if s == STATUS_OVERFLOW && self.victims.len() < MAX_ANSWER {
                let n = (self.victims.len() * 4).min(MAX_ANSWER);
                self.victims.resize(n, RawVictim::default());
                continue;
            }
            if !self.check("choose_victims", s) {
                return;
            }
            break;
        }
        if len > self.victims.len() {
            self.failure = Some(format!(
                "plugin choose_victims reported {len} entries for a buffer of {}",
                self.victims.len()
            ));
            return;
        }
        victims.extend(self.victims[..len].iter().map(|v| (v.vm, v.block)));
    }

    fn on_evicted(&mut self, vm: VmId, block: BlockId) {
        if self.alive() {
            // SAFETY: ABI call on a live instance.
            let s = unsafe { (self.vt.on_evicted)(self.state, vm, block) };
            self.check("on_evicted", s);
        }
    }

    fn failure(&mut self) -> Option<String> {
        self.failure.clone()
    }
}
