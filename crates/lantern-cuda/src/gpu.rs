//! One CUDA device: its context, the stream all work runs on, the compiled kernels, cuBLAS.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{sys as cublas_sys, CudaBlas};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys, Ptx};

use crate::error::{CudaError, Result};
use crate::graph::{GraphState, EAGER};
use crate::kernels::{KernelSource, PRELUDE, SOURCES};
use crate::libs;
use crate::profile::{profiler_requested, Profiler};

/// The SM count assumed when the driver does not report one (an H100 SXM's).
const DEFAULT_SM_COUNT: usize = 132;
/// cuBLAS's workspace, set once so that no product allocates one inside a captured graph
/// (32 MiB: what cuBLAS asks for on Hopper).
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A loaded kernel and its name.
#[derive(Clone, Copy)]
pub(crate) struct Kernel<'a> {
    pub(crate) name: &'static str,
    pub(crate) func: &'a CudaFunction,
}

/// A CUDA device ready for lantern's work.
///
/// All work (kernels, copies, cuBLAS) is queued on one stream, [`Gpu::stream`], a created
/// (non-blocking) stream so that it can be captured into CUDA graphs. cudarc's per-buffer
/// event tracking is turned off for the context: buffers used on another stream must be
/// synchronized by their user.
pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) functions: HashMap<&'static str, CudaFunction>,
    pub(crate) blas: CudaBlas,
    name: String,
    ordinal: usize,
    compute_capability: (i32, i32),
    sm_count: usize,
    /// Whether kernels are launched to overlap the one ahead of them (`launch.rs`).
    /// Turned off for good if the driver refuses such a launch that a plain one then
    /// takes (launch.rs).
    pub(crate) programmatic_launch: AtomicBool,
    /// Times each eager launch where `LANTERN_CUDA_PROFILE` is on, or once
    /// [`Gpu::time_kernels`] was called.
    profiler: OnceLock<Profiler>,
    /// Split-K attention's partial results, kept between calls and grown as needed (all
    /// work is on the one stream, so a call's kernels follow the previous call's merge).
    pub(crate) attn_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// Decode-step graphs (see `graph.rs`), and whether a graph step is running.
    pub(crate) graphs: Mutex<GraphState>,
    pub(crate) graph_mode: AtomicU8,
    /// Held for cuBLAS, which was given its address.
    _blas_workspace: CudaSlice<u8>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("ordinal", &self.ordinal)
            .field("compute_capability", &self.compute_capability)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

impl Gpu {
    /// Opens device `ordinal`: checks the libraries, creates the context and stream, compiles every kernel.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        libs::check_driver()?;
        libs::check_nvrtc()?;
        libs::check_cublas()?;
        let count = CudaContext::device_count()?.max(0) as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: called before any buffer of this context exists; all of lantern's work
        // runs on the one stream below, which orders it.
        unsafe { ctx.disable_event_tracking() };
        let compute_capability = ctx.compute_capability()?;
        let name = ctx.name()?;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n > 0)
            .unwrap_or(DEFAULT_SM_COUNT);
        let stream = ctx.new_stream()?;
        let (major, minor) = compute_capability;
        let cc = (major * 10 + minor) as u32;
        let target = Target::for_device(cc)?;
        let mut functions = HashMap::new();
        for src in SOURCES {
            let image = compile(src, &target)?;
            let module = ctx.load_module(image)?;
            for &f in src.functions {
                functions.insert(f, module.load_function(f)?);
            }
        }
        let blas = CudaBlas::new(stream.clone())?;
        // True f32 products: no TF32 (16-bit inputs still use tensor cores).
        // SAFETY: a valid handle; the mode is a plain enum.
        unsafe {
            cublas_sys::cublasSetMathMode(
                *blas.handle(),
                cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
            )
        }
        .result()?;
        // SAFETY: cuBLAS's scratch; it writes before it reads.
        let blas_workspace = unsafe { stream.alloc::<u8>(CUBLAS_WORKSPACE_BYTES) }?;
        {
            let (ptr, _guard) = blas_workspace.device_ptr(&stream);
            // SAFETY: a live device buffer of the size given, kept as long as the handle.
            unsafe {
                cublas_sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut std::ffi::c_void,
                    CUBLAS_WORKSPACE_BYTES,
                )
            }
            .result()?;
        }
        let gpu = Arc::new(Gpu {
            ctx,
            stream,
            functions,
            blas,
            name,
            ordinal,
            compute_capability,
            sm_count,
            programmatic_launch: AtomicBool::new(crate::launch::pdl_enabled(cc)),
            profiler: OnceLock::new(),
            attn_scratch: Mutex::new(None),
            graphs: Mutex::new(GraphState::new()),
            graph_mode: AtomicU8::new(EAGER),
            _blas_workspace: blas_workspace,
        });
        if profiler_requested() {
            gpu.time_kernels();
        }
        Ok(gpu)
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device ordinal this was opened on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Streaming multiprocessors of the device (132 where the driver does not say).
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// Free and total device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every operation of this `Gpu` is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The cuBLAS handle (bound to [`Gpu::stream`]).
    pub fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// Copies `data` to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.check_fits(std::mem::size_of_val(data))?;
        Ok(self.stream.clone_htod(data)?)
    }

    /// A new device buffer of `n` zeros.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.check_fits(n.saturating_mul(std::mem::size_of::<T>()))?;
        Ok(self.stream.alloc_zeros(n)?)
    }

    /// A new device buffer of `n` elements left as they are, for an output a kernel
    /// overwrites entirely (no memset launch on the step's path).
    pub fn output<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.check_fits(n.saturating_mul(std::mem::size_of::<T>()))?;
        // SAFETY: callers hand the buffer to a kernel that writes every element before
        // anything reads it.
        Ok(unsafe { self.stream.alloc(n) }?)
    }

    /// Copies a device buffer (slice, view) back to the host, waiting for the stream.
    /// During a graph step, the first download launches the step's graph.
    pub fn download<T: DeviceRepr, S: DevicePtr<T>>(&self, src: &S) -> Result<Vec<T>> {
        self.flush_graph()?;
        Ok(self.stream.clone_dtoh(src)?)
    }

    /// Copies a device buffer to the end of `dst`, waiting for the stream: one copy
    /// into `dst`'s own memory, for results gathered piece by piece.
    pub fn download_append<T, S>(&self, src: &S, dst: &mut Vec<T>) -> Result<()>
    where
        T: DeviceRepr + ValidAsZeroBits + Default + Clone,
        S: DevicePtr<T>,
    {
        self.flush_graph()?;
        let start = dst.len();
        dst.resize(start + src.len(), T::default());
        self.stream.memcpy_dtoh(src, &mut dst[start..])?;
        Ok(self.stream.synchronize()?)
    }

    /// Waits for all work queued on the stream (launching a graph step's graph first).
    pub fn synchronize(&self) -> Result<()> {
        self.flush_graph()?;
        Ok(self.stream.synchronize()?)
    }

    /// The compiled kernel `name`.
    pub(crate) fn function(&self, name: &str) -> Result<Kernel<'_>> {
        self.functions
            .get_key_value(name)
            .map(|(&name, func)| Kernel { name, func })
            .ok_or_else(|| CudaError::Driver(format!("kernel {name} is not loaded")))
    }

    /// Whether kernels are launched to overlap the one before them (launch.rs).
    pub fn launches_overlap(&self) -> bool {
        self.programmatic_launch.load(Ordering::Relaxed)
    }

    /// Runs `work` (which queues `name`'s work on the stream) timed by the profiler when
    /// there is one and the step runs eagerly (profile.rs).
    pub(crate) fn timed<T>(
        &self,
        name: &'static str,
        work: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        match self.profiler.get() {
            Some(p) if !self.in_graph_step() => p.time(&self.stream, name, work),
            _ => work(),
        }
    }

    /// Times every eager launch from now on (as `LANTERN_CUDA_PROFILE=on` does from the
    /// start): [`Gpu::kernel_times`].
    pub fn time_kernels(&self) {
        self.profiler.get_or_init(Profiler::default);
    }

    /// Device time per kernel so far, where kernels are timed (profile.rs).
    pub fn kernel_times(&self) -> Result<Option<Vec<lantern_attn::KernelTime>>> {
        self.profiler.get().map(|p| p.report()).transpose()
    }

    /// An allocation of `bytes` fails early with [`CudaError::OutOfMemory`] when it cannot fit.
    /// Refuses an allocation larger than the free memory with a clear error (instead of
    /// the driver's). Small ones (a step's activations) skip the query, which costs a
    /// driver call.
    pub(crate) fn check_fits(&self, bytes: usize) -> Result<()> {
        const ASK_ABOVE: usize = 64 << 20;
        if bytes < ASK_ABOVE {
            return Ok(());
        }
        if let Ok((free, _)) = self.ctx.mem_get_info() {
            if bytes > free {
                return Err(CudaError::OutOfMemory { bytes, free });
            }
        }
        Ok(())
    }
}

/// What NVRTC produces: a cubin for a real architecture, or PTX for the driver to finish.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    Cubin(u32),
    Ptx(u32),
}

impl Target {
    /// A cubin for `cc` when NVRTC knows it, else PTX for the newest architecture below it.
    fn for_device(cc: u32) -> Result<Target> {
        let archs = supported_archs()?;
        if archs.contains(&cc) {
            return Ok(Target::Cubin(cc));
        }
        archs
            .iter()
            .copied()
            .filter(|&a| a <= cc)
            .max()
            .map(Target::Ptx)
            .ok_or_else(|| CudaError::Nvrtc {
                kernel: String::from("(all)"),
                log: format!(
                    "this NVRTC supports architectures {archs:?}, none at or below sm_{cc}"
                ),
            })
    }
}

/// The architectures (as 10 * major + minor) this NVRTC compiles for.
fn supported_archs() -> Result<Vec<u32>> {
    let mut n: c_int = 0;
    // SAFETY: plain out-parameters sized by the first call.
    unsafe { nvrtc_sys::nvrtcGetNumSupportedArchs(&mut n) }.result()?;
    let mut archs = vec![0 as c_int; n.max(0) as usize];
    unsafe { nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }.result()?;
    Ok(archs.into_iter().map(|a| a as u32).collect())
}

/// The full text NVRTC compiles for a kernel source (the prelude, then the source).
pub(crate) fn full_source(src: &KernelSource) -> String {
    format!("{PRELUDE}\n#line 1 \"{}\"\n{}", src.name, src.source)
}

/// Compiles one kernel source for `target` with NVRTC.
pub(crate) fn compile(src: &KernelSource, target: &Target) -> Result<Ptx> {
    let err = |log: String| CudaError::Nvrtc {
        kernel: src.name.to_string(),
        log,
    };
    let text = std::ffi::CString::new(full_source(src)).map_err(|e| err(e.to_string()))?;
    let name = std::ffi::CString::new(src.name).map_err(|e| err(e.to_string()))?;
    let prog =
        nvrtc_result::create_program(&text, Some(&name)).map_err(|e| err(format!("{e:?}")))?;
    let arch = match target {
        Target::Cubin(cc) => format!("--gpu-architecture=sm_{cc}"),
        Target::Ptx(cc) => format!("--gpu-architecture=compute_{cc}"),
    };
    let options = [arch, String::from("--std=c++17")];
    // SAFETY: `prog` is a live program until destroyed at the end of this function.
    let out = unsafe {
        match nvrtc_result::compile_program(prog, &options) {
            Ok(()) => match target {
                Target::Cubin(_) => get_cubin(prog).map(Ptx::from_binary),
                Target::Ptx(_) => get_ptx(prog).map(Ptx::from_src),
            }
            .map_err(|e| err(format!("{e:?}"))),
            Err(e) => Err(err(format!(
                "{e:?} ({})\n{}",
                options.join(" "),
                program_log(prog)
            ))),
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc_result::destroy_program(prog) };
    out
}

unsafe fn program_log(prog: nvrtc_sys::nvrtcProgram) -> String {
    match nvrtc_result::get_program_log(prog) {
        Ok(raw) => CStr::from_ptr(raw.as_ptr()).to_string_lossy().into_owned(),
        Err(e) => format!("(no log: {e:?})"),
    }
}

unsafe fn get_ptx(
    prog: nvrtc_sys::nvrtcProgram,
) -> std::result::Result<String, nvrtc_result::NvrtcError> {
    let raw = nvrtc_result::get_ptx(prog)?;
    Ok(CStr::from_ptr(raw.as_ptr()).to_string_lossy().into_owned())
}

unsafe fn get_cubin(
    prog: nvrtc_sys::nvrtcProgram,
) -> std::result::Result<Vec<u8>, nvrtc_result::NvrtcError> {
    let mut size: usize = 0;
    nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
    let mut buf = vec![0u8; size];
    nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char).result()?;
    Ok(buf)
}

/// Compiles every kernel source with NVRTC, to PTX for compute_90 and to a cubin for sm_90
/// (which runs ptxas over the inline PTX); needs no device. Errors name the source and carry the log.
pub fn compile_all_kernels_ptx() -> Result<()> {
    libs::check_nvrtc()?;
    for src in SOURCES {
        let ptx = compile(src, &Target::Ptx(90))?.to_src();
        for f in src.functions {
            if !ptx.contains(&format!(".entry {f}(")) {
                return Err(CudaError::Nvrtc {
                    kernel: src.name.to_string(),
                    log: format!("the compiled PTX has no kernel {f}"),
                });
            }
        }
        // Each kernel's lt_grid_dependency (launch.rs) is compiled in at sm_90. (The CUDA
        // emulator's modules are no PTX: it checks every thread's wait as kernels run.)
        let emulated = ptx.contains("\n.emulated ");
        let waits = ptx.matches("griddepcontrol.wait").count();
        if !emulated && waits < src.functions.len() {
            return Err(CudaError::Nvrtc {
                kernel: src.name.to_string(),
                log: format!(
                    "{waits} griddepcontrol.wait in the PTX of {} kernels",
                    src.functions.len()
                ),
            });
        }
        compile(src, &Target::Cubin(90))?;
    }
    Ok(())
}
