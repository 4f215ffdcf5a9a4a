//! `pagesim` for Python: replays a request trace through a paging policy
//! written in Python (or a built-in one), with the simulator, ledger and
//! disk models of the `pagesim` binary.
//!
//! ```python
//! import pagesim
//! report = pagesim.simulate(MyPolicy(), trace="experiments/traces/zipf-4000vm-a1.0.trace")
//! report = pagesim.simulate("demand", vms=400, alpha=1.0, requests=100_000, mem="64M")
//! ```
//!
//! `simulate` takes pagesim's options as keywords (`guest_mem="4M"` is
//! `--guest-mem 4M`) with pagesim's defaults, and returns the dictionary
//! `pagesim --json` prints. A Python policy is driven through `PyPolicy`,
//! which implements [`Policy`] by calling its methods.

use paging_policy::error::PagerError;
use paging_policy::policy::{BlockId, Policy, SwapLayout, VmId};
use paging_policy::replay::{PagesimArgs, Replay};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString};
use std::sync::{Arc, Mutex};

pyo3::create_exception!(
    pagesim,
    SimulationError,
    PyRuntimeError,
    "The simulation stopped: the policy raised, or gave an answer the ledger refused."
);

/// Why `simulate` failed.
#[derive(Debug, thiserror::Error)]
enum SimError {
    /// An option is unknown or its value is invalid, or the setting is
    /// inconsistent (pagesim's exit status 2).
    #[error("{0}")]
    Config(String),
    /// The replay stopped (pagesim's exit status 1).
    #[error("{0}")]
    Run(PagerError),
}

/// A policy's methods, looked up once; `None` for a method the object does
/// not define (or inherits as a no-op from the base class), which is then
/// never called.
struct Hooks {
    on_vm_registered: Option<Py<PyAny>>,
    on_vm_unregistered: Option<Py<PyAny>>,
    on_access: Option<Py<PyAny>>,
    on_fault: Option<Py<PyAny>>,
    on_installed: Option<Py<PyAny>>,
    choose_victims: Py<PyAny>,
    on_evicted: Option<Py<PyAny>>,
    on_quota_eviction: Option<Py<PyAny>>,
}

/// A Python object driven as a [`Policy`].
///
/// The first exception a method raises, or the first answer of the wrong
/// shape, is kept: [`Policy::failure`] reports it as one line, the ledger
/// stops the run, and no method is called after it.
struct PyPolicy {
    name: String,
    layout: SwapLayout,
    hooks: Hooks,
    failure: Option<String>,
    /// The exception behind `failure`, for `simulate` to chain to the
    /// `SimulationError` (the policy itself is owned by the simulator).
    cause: Arc<Mutex<Option<PyErr>>>,
}

/// The attribute the base class (`scalebench.policydev.pypolicy.Policy`)
/// sets on its no-op methods, so that a subclass that does not override
/// one costs no call.
const DEFAULT_MARK: &str = "__pagesim_default__";

fn hook(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<Py<PyAny>>> {
    let Some(method) = obj.getattr_opt(name)? else {
        return Ok(None);
    };
    if method.getattr_opt(DEFAULT_MARK)?.is_some() {
        return Ok(None);
    }
    if !method.is_callable() {
        return Err(PyValueError::new_err(format!(
            "policy attribute {name} is not callable"
        )));
    }
    Ok(Some(method.unbind()))
}

impl PyPolicy {
    /// Wraps `obj`: reads `name` (default: its class name) and `layout`
    /// (`"per-vm"`, the default, or `"log"`), and looks up its methods.
    /// `choose_victims` is required.
    fn new(obj: &Bound<'_, PyAny>) -> PyResult<PyPolicy> {
        let name = match obj.getattr_opt("name")? {
            Some(n) => n.extract::<String>()?,
            None => obj.get_type().name()?.to_string(),
        };
        let layout = match obj.getattr_opt("layout")? {
            None => SwapLayout::PerVm,
            Some(l) => match l.extract::<String>()?.as_str() {
                "per-vm" => SwapLayout::PerVm,
                "log" => SwapLayout::Log,
                other => {
                    return Err(PyValueError::new_err(format!(
                        "policy {name}: layout must be \"per-vm\" or \"log\", not {other:?}"
                    )))
                }
            },
        };
        let choose_victims = hook(obj, "choose_victims")?.ok_or_else(|| {
            PyValueError::new_err(format!("policy {name} has no choose_victims method"))
        })?;
        Ok(PyPolicy {
            hooks: Hooks {
                on_vm_registered: hook(obj, "on_vm_registered")?,
                on_vm_unregistered: hook(obj, "on_vm_unregistered")?,
                on_access: hook(obj, "on_access")?,
                on_fault: hook(obj, "on_fault")?,
                on_installed: hook(obj, "on_installed")?,
                choose_victims,
                on_evicted: hook(obj, "on_evicted")?,
                on_quota_eviction: hook(obj, "on_quota_eviction")?,
            },
            name,
            layout,
            failure: None,
            cause: Arc::default(),
        })
    }

    /// Records the first failure of `method`.
    fn fail(&mut self, method: &str, err: PyErr) {
        if self.failure.is_none() {
            let text = err.to_string();
            let first = text.lines().next().unwrap_or("");
            self.failure = Some(format!("{method} raised {first}"));
            *self.cause.lock().expect("not poisoned") = Some(err);
        }
    }

    /// Calls the optional `hook` with `args` (nothing once failed).
    fn notify<A>(&mut self, method: &str, hook: fn(&Hooks) -> &Option<Py<PyAny>>, args: A)
    where
        A: for<'py> pyo3::call::PyCallArgs<'py>,
    {
        if self.failure.is_some() {
            return;
        }
        let Some(f) = hook(&self.hooks) else {
            return;
        };
        if let Err(e) = Python::attach(|py| f.bind(py).call1(args).map(drop)) {
            self.fail(method, e);
        }
    }
}

/// Pushes every item of a method's answer, an iterable or `None`, into `out`.
fn collect<'py, T: FromPyObjectOwned<'py>>(
    answer: &Bound<'py, PyAny>,
    out: &mut Vec<T>,
) -> PyResult<()> {
    if answer.is_none() {
        return Ok(());
    }
    for item in answer.try_iter()? {
        out.push(item?.extract::<T>().map_err(Into::into)?);
    }
    Ok(())
}

impl Policy for PyPolicy {
    fn name(&self) -> &str {
        &self.name
    }

    fn layout(&self) -> SwapLayout {
        self.layout
    }

    fn on_vm_registered(&mut self, vm: VmId, blocks: u32) {
        self.notify("on_vm_registered", |h| &h.on_vm_registered, (vm, blocks));
    }

    fn on_vm_unregistered(&mut self, vm: VmId) {
        self.notify("on_vm_unregistered", |h| &h.on_vm_unregistered, (vm,));
    }

    fn on_access(&mut self, vm: VmId) {
        self.notify("on_access", |h| &h.on_access, (vm,));
    }

    fn on_fault(&mut self, vm: VmId, block: BlockId, prefetch: &mut Vec<BlockId>) {
        if self.failure.is_some() {
            return;
        }
        let Some(f) = &self.hooks.on_fault else {
            return;
        };
        let answer = Python::attach(|py| collect(&f.bind(py).call1((vm, block))?, prefetch));
        if let Err(e) = answer {
            self.fail("on_fault", e);
        }
    }

    fn on_installed(&mut self, vm: VmId, block: BlockId) {
        self.notify("on_installed", |h| &h.on_installed, (vm, block));
    }

    fn choose_victims(&mut self, need: u32, faulting_vm: VmId, victims: &mut Vec<(VmId, BlockId)>) {
        if self.failure.is_some() {
            return;
        }
        let f = &self.hooks.choose_victims;
        let answer = Python::attach(|py| collect(&f.bind(py).call1((need, faulting_vm))?, victims));
        if let Err(e) = answer {
            self.fail("choose_victims", e);
        }
    }

    fn on_evicted(&mut self, vm: VmId, block: BlockId) {
        self.notify("on_evicted", |h| &h.on_evicted, (vm, block));
    }

    fn on_quota_eviction(&mut self, vm: VmId) {
        self.notify("on_quota_eviction", |h| &h.on_quota_eviction, (vm,));
    }

    fn failure(&mut self) -> Option<String> {
        self.failure.clone()
    }
}

/// Turns `simulate`'s keywords into pagesim's command line: `guest_mem="4M"`
/// is `--guest-mem 4M`, `True` a bare flag, `False` and `None` nothing.
fn argv(options: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<String>> {
    let mut argv = vec!["pagesim".to_string()];
    for (key, value) in options.into_iter().flatten() {
        let flag = format!("--{}", key.extract::<String>()?.replace('_', "-"));
        if value.is_none() || value.cast::<PyBool>().is_ok_and(|b| !b.is_true()) {
            continue;
        }
        argv.push(flag);
        if !value.is_instance_of::<PyBool>() {
            argv.push(value.str()?.to_string());
        }
    }
    Ok(argv)
}

/// Runs the simulation `argv` describes with `policy`, returning its
/// `pagesim --json` report.
fn run(argv: Vec<String>, policy: Option<Box<dyn Policy>>) -> Result<serde_json::Value, SimError> {
    let args = <PagesimArgs as clap::Parser>::try_parse_from(argv).map_err(|e| {
        let text = e.to_string();
        SimError::Config(
            text.lines()
                .next()
                .unwrap_or("")
                .trim_start_matches("error: ")
                .to_string(),
        )
    })?;
    // A policy failing while the VMs register stops a run; anything else
    // before the first request is configuration.
    let replay = Replay::new(&args, policy).map_err(|e| match e {
        PagerError::PolicyFailed { .. } => SimError::Run(e),
        _ => SimError::Config(e.to_string()),
    })?;
    Ok(replay.run().map_err(SimError::Run)?.to_json())
}

/// simulate(policy, **options) -> dict
///
/// Replays a trace through `policy` and returns the report `pagesim --json`
/// prints (hit_ratio, faults, swap traffic, predicted_rps,
/// sim_requests_per_second, ...). `policy` is a Python object with pagesim's
/// policy methods (see scalebench.policydev.pypolicy.Policy) or a
/// `--policy` string (demand, wsswap, a plugin path). `options` are
/// pagesim's flags as keywords: trace, vms, alpha, requests, seed, ws,
/// extra, guest_mem, mem, block, disk, swap_size, vm_resident_max, cpu_us,
/// fault_us, dirty, warmup, concurrency; sizes as numbers or strings ("32k").
///
/// Raises ValueError for a bad option or policy object, SimulationError when
/// the policy raises (chained as its cause) or gives an answer the ledger
/// refuses.
#[pyfunction]
#[pyo3(signature = (policy, **options))]
fn simulate<'py>(
    py: Python<'py>,
    policy: &Bound<'py, PyAny>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    let mut argv = argv(options)?;
    let (result, cause) = if let Ok(spec) = policy.cast::<PyString>() {
        argv.extend(["--policy".to_string(), spec.to_string()]);
        // No Python runs in a built-in policy: other threads may.
        (py.detach(|| run(argv, None)), None)
    } else {
        let p = PyPolicy::new(policy)?;
        let cause = Arc::clone(&p.cause);
        (run(argv, Some(Box::new(p))), Some(cause))
    };
    let report = result.map_err(|e| match e {
        SimError::Config(text) => PyValueError::new_err(text),
        SimError::Run(err) => {
            let exc = SimulationError::new_err(err.to_string());
            let cause = cause.and_then(|c| c.lock().expect("not poisoned").take());
            exc.set_cause(py, cause);
            exc
        }
    })?;
    py.import("json")?
        .call_method1("loads", (report.to_string(),))
}

/// pagesim for Python: replay traces through a paging policy written in Python.
#[pymodule]
fn pagesim(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add("SimulationError", m.py().get_type::<SimulationError>())?;
    Ok(())
}
