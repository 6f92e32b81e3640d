//! Dense products through cuBLAS: y = x · wᵀ for row-major x `[m, k]`, w `[n, k]`, y `[m, n]`.
//!
//! cuBLAS is column-major. A row-major `[r, c]` matrix with leading dimension c is, read as
//! column-major, its transpose: a `[c, r]` matrix with ld = c. So
//!   y (row-major m×n)  = yᵀ read column-major: an n×m matrix, ldc = n;
//!   w (row-major n×k)  = a k×n column-major matrix, lda = k; op T makes it n×k;
//!   x (row-major m×k)  = a k×m column-major matrix, ldb = k; op N keeps it k×m.
//! yᵀ = w · xᵀ is (n×k)·(k×m) = n×m, which is y = x · wᵀ. The call is therefore
//! gemm(transa = T, transb = N, m' = n, n' = m, k' = k, A = w, lda = k, B = x, ldb = k,
//! C = y, ldc = n).

use std::ffi::c_void;

use cudarc::cublas::{result as cublas_result, sys as cublas_sys};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::error::{ensure, CudaError, Result};
use crate::gpu::Gpu;

impl Gpu {
    /// y `[m, n]` (f32) = x `[m, k]` · wᵀ (w `[n, k]`), bf16 inputs, f32 accumulation.
    pub fn gemm_bf16(
        &self,
        x: &impl DevicePtr<half::bf16>,
        w: &impl DevicePtr<half::bf16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemm_ex(
            x,
            w,
            y,
            (m, n, k),
            cublas_sys::cudaDataType_t::CUDA_R_16BF,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    }

    /// Columns `[col0, col0 + n)` of y `[m, width]` (f32) = x `[m, k]` · wᵀ (w `[n, k]`),
    /// bf16 inputs, f32 accumulation: a product over some rows of a matrix, written where
    /// the whole product's output has them.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_bf16_columns(
        &self,
        x: &impl DevicePtr<half::bf16>,
        w: &impl DevicePtr<half::bf16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        (col0, n, width): (usize, usize, usize),
        k: usize,
    ) -> Result<()> {
        ensure(k > 0, || "gemm: columns of an empty product".into())?;
        self.gemm_at(
            x,
            w,
            y,
            (m, n, k),
            (col0, width),
            cublas_sys::cudaDataType_t::CUDA_R_16BF,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    }

    /// y `[m, n]` = x `[m, k]` · wᵀ (w `[n, k]`), all f32, true f32 arithmetic (no TF32).
    pub fn gemm_f32(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemm_ex(
            x,
            w,
            y,
            (m, n, k),
            cublas_sys::cudaDataType_t::CUDA_R_32F,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
        )
    }

    fn gemm_ex<T>(
        &self,
        x: &impl DevicePtr<T>,
        w: &impl DevicePtr<T>,
        y: &mut impl DevicePtrMut<f32>,
        (m, n, k): (usize, usize, usize),
        in_type: cublas_sys::cudaDataType_t,
        compute: cublas_sys::cublasComputeType_t,
    ) -> Result<()> {
        ensure(y.len() == m * n, || {
            format!("gemm: y {} values for m {m}, n {n}", y.len())
        })?;
        if k == 0 && m > 0 && n > 0 && !self.skips_launches() {
            self.stream.memset_zeros(y)?;
            return Ok(());
        }
        self.gemm_at(x, w, y, (m, n, k), (0, n), in_type, compute)
    }

    /// The product into columns `[col0, col0 + n)` of y `[m, width]`.
    #[allow(clippy::too_many_arguments)]
    fn gemm_at<T>(
        &self,
        x: &impl DevicePtr<T>,
        w: &impl DevicePtr<T>,
        y: &mut impl DevicePtrMut<f32>,
        (m, n, k): (usize, usize, usize),
        (col0, width): (usize, usize),
        in_type: cublas_sys::cudaDataType_t,
        compute: cublas_sys::cublasComputeType_t,
    ) -> Result<()> {
        ensure(
            x.len() == m * k && w.len() == n * k && y.len() == m * width && col0 + n <= width,
            || {
                format!(
                    "gemm: x {}, w {}, y {} values for m {m}, n {n} (columns from {col0} of \
                     {width}), k {k}",
                    x.len(),
                    w.len(),
                    y.len()
                )
            },
        )?;
        if m == 0 || n == 0 || k == 0 || self.skips_launches() {
            return Ok(());
        }
        let dim = |what: &str, v: usize| {
            i32::try_from(v)
                .map_err(|_| CudaError::Shape(format!("gemm: {what} = {v} exceeds i32")))
        };
        let (m32, n32, k32, ldc) = (
            dim("m", m)?,
            dim("n", n)?,
            dim("k", k)?,
            dim("width", width)?,
        );
        let alpha: f32 = 1.0;
        let beta: f32 = 0.0;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        let (yp, _gy) = y.device_ptr_mut(&self.stream);
        let yp = yp + (col0 * std::mem::size_of::<f32>()) as u64;
        let name = if in_type == cublas_sys::cudaDataType_t::CUDA_R_16BF {
            "cublas_gemm_bf16"
        } else {
            "cublas_gemm_f32"
        };
        // SAFETY: the pointers are live device buffers of the checked lengths, on the
        // handle's stream; alpha and beta are host f32 as the f32 compute type expects.
        self.timed(name, || unsafe {
            Ok(cublas_result::gemm_ex(
                *self.blas.handle(),
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                n32,
                m32,
                k32,
                &alpha as *const f32 as *const c_void,
                wp as *const c_void,
                in_type,
                k32,
                xp as *const c_void,
                in_type,
                k32,
                &beta as *const f32 as *const c_void,
                yp as *mut c_void,
                cublas_sys::cudaDataType_t::CUDA_R_32F,
                ldc,
                compute,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?)
        })
    }
}
