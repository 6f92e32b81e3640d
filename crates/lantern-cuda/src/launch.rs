//! Kernel launches, with programmatic dependent launch where the device has it.
//!
//! On compute capability 9.0 and later a kernel may be launched before the one ahead of
//! it on the stream has finished (`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`):
//! its blocks are placed on the multiprocessors while the previous kernel's last blocks
//! still run, and wait at `griddepcontrol.wait` (prelude.cu's `lt_grid_dependency`, the
//! first statement of every kernel) until that kernel has completed and its writes are
//! visible. A decode step at batch 1 is ~180 small dependent kernels, each otherwise
//! paying its launch after the previous one drains; with this, the launch overlaps it.
//! Graph capture keeps the overlap (its edges become programmatic ones).
//!
//! `LANTERN_CUDA_PDL=off` launches every kernel the plain way.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{
    self, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchAttributeValue, CUlaunchConfig,
};
use cudarc::driver::{DeviceRepr, DriverError, LaunchConfig};

use crate::gpu::{Gpu, Kernel};

/// First compute capability (major * 10 + minor) with programmatic dependent launch.
pub const PDL_MIN_CC: u32 = 90;

/// Whether kernels on a device of compute capability `cc` are launched with programmatic
/// dependent launch: from [`PDL_MIN_CC`] on, unless `LANTERN_CUDA_PDL` is `off`.
pub fn pdl_enabled(cc: u32) -> bool {
    cc >= PDL_MIN_CC && !pdl_switched_off(std::env::var("LANTERN_CUDA_PDL").ok().as_deref())
}

fn pdl_switched_off(setting: Option<&str>) -> bool {
    matches!(setting.map(str::trim), Some("off" | "0" | "false" | "no"))
}

/// One kernel launch being put together: the kernel, its arguments (addresses of values
/// that live as long as the builder), and the GPU, which says whether it may overlap the
/// kernel ahead of it and times it when asked (profile.rs).
pub struct Launch<'a> {
    gpu: &'a Gpu,
    kernel: Kernel<'a>,
    args: Vec<*mut c_void>,
}

impl<'a> Launch<'a> {
    pub(crate) fn new(gpu: &'a Gpu, kernel: Kernel<'a>) -> Self {
        Self {
            gpu,
            kernel,
            args: Vec::with_capacity(16),
        }
    }

    /// Appends the next kernel argument.
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut c_void);
        self
    }

    /// Queues the kernel on the stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and
    /// the kernel must stay inside the buffers it is given.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> crate::Result<()> {
        let (gpu, name) = (self.gpu, self.kernel.name);
        // SAFETY: the caller's contract.
        gpu.timed(name, || Ok(unsafe { self.queue(cfg) }?))
    }

    /// # Safety
    /// As [`Launch::launch`].
    unsafe fn queue(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.gpu.stream.context().bind_to_thread()?;
        if !self.gpu.launches_overlap() {
            // SAFETY: the caller's contract.
            return unsafe { self.queue_plain(cfg) };
        }
        // SAFETY: the caller's contract.
        let overlapped = unsafe { self.queue_overlapped(cfg) };
        let Err(refused) = overlapped else {
            return Ok(());
        };
        // A driver that refuses the attribute loses the overlap, not the kernel: every
        // launch from now on is plain (a graph being captured fails once and is captured
        // again later), and this one is tried the plain way.
        if self.gpu.programmatic_launch.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                "kernels launch without overlap from now on: the driver refused a \
                 programmatic dependent launch of {} ({refused})",
                self.kernel.name
            );
        }
        // SAFETY: the caller's contract.
        unsafe { self.queue_plain(cfg) }
    }

    /// # Safety
    /// As [`Launch::launch`].
    unsafe fn queue_plain(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        let stream = &self.gpu.stream;
        let f = self.kernel.func.cu_function();
        let params = self.args.as_mut_ptr();
        // SAFETY: the caller's contract; `params` holds one address per argument.
        unsafe {
            sys::cuLaunchKernel(
                f,
                cfg.grid_dim.0,
                cfg.grid_dim.1,
                cfg.grid_dim.2,
                cfg.block_dim.0,
                cfg.block_dim.1,
                cfg.block_dim.2,
                cfg.shared_mem_bytes,
                stream.cu_stream(),
                params,
                std::ptr::null_mut(),
            )
        }
        .result()
    }

    /// # Safety
    /// As [`Launch::launch`].
    unsafe fn queue_overlapped(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        let stream = &self.gpu.stream;
        let f = self.kernel.func.cu_function();
        let params = self.args.as_mut_ptr();
        let mut value = CUlaunchAttributeValue { pad: [0; 64] };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attribute = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: &mut attribute,
            numAttrs: 1,
        };
        // SAFETY: as above; `config` and its one attribute live through the call.
        unsafe { sys::cuLaunchKernelEx(&config, f, params, std::ptr::null_mut()) }.result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_reads_off_and_its_synonyms() {
        for off in ["off", "0", "false", "no", " off "] {
            assert!(pdl_switched_off(Some(off)), "{off:?}");
        }
        for on in [None, Some("on"), Some("1"), Some("")] {
            assert!(!pdl_switched_off(on), "{on:?}");
        }
    }

    /// Every kernel must wait for the grid ahead of it before it reads or writes anything:
    /// a kernel launched to overlap its predecessor that did not would race it.
    #[test]
    fn every_kernel_first_waits_for_the_grid_before_it() {
        for src in crate::kernels::SOURCES {
            let text = src.source;
            let mut found = 0;
            for (at, _) in text.match_indices("__global__") {
                let body = &text[at..];
                let open = body.find('{').expect("a kernel has a body");
                let first =
                    body[open + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                assert!(
                    first.starts_with("lt_grid_dependency();"),
                    "{}: the kernel at byte {at} starts with {:?}, not lt_grid_dependency();",
                    src.name,
                    &first[..first.len().min(60)]
                );
                found += 1;
            }
            assert!(
                found > 0 || src.functions.is_empty(),
                "{}: no kernels",
                src.name
            );
        }
    }
}
