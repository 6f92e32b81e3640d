//! Kernels against CPU references. The NVRTC test needs only libnvrtc; the GPU tests skip
//! (one printed line) where no device can be opened.

use lantern_cuda::{compile_all_kernels_ptx, CudaError};

#[test]
fn every_kernel_compiles_with_nvrtc() {
    match compile_all_kernels_ptx() {
        Ok(()) => {}
        Err(CudaError::LibraryMissing { looked_for, .. }) => {
            println!("skipped: no NVRTC ({looked_for})");
        }
        Err(e) => panic!("{e}"),
    }
}

mod gpu_tests {
    use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

    use candle_core::quantized::{GgmlDType, QTensor};
    use half::{bf16, f16};
    use lantern_cuda::gemv::{GemvExtras, GemvWeights};
    use lantern_cuda::reduce;
    use lantern_cuda::{
        Activation, AttnParams, CacheElem, CudaError, Gpu, KvStrides, PagedMeta, RopeStep,
    };
    use lantern_model::pick::{self, SampleDraw};
    use lantern_model::{
        LogitEdit, ReducedRow, RowReduction, RowScore, TokenChoice, MAX_REDUCED_TOP_LOGPROBS,
    };
    use lantern_quant::{Blockwise, QuantType};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The device, or None (after one printed line) where there is none; tests take turns.
    fn gpu() -> Option<(Arc<Gpu>, MutexGuard<'static, ()>)> {
        static GPU: OnceLock<Option<Arc<Gpu>>> = OnceLock::new();
        static TURN: Mutex<()> = Mutex::new(());
        let g = GPU.get_or_init(|| match Gpu::open(0) {
            Ok(g) => Some(g),
            Err(
                e @ (CudaError::LibraryMissing { .. }
                | CudaError::NoDevice { .. }
                | CudaError::Driver(_)),
            ) => {
                println!("skipped: no GPU ({e})");
                None
            }
            Err(e) => panic!("{e}"),
        });
        let g = g.clone()?;
        Some((g, TURN.lock().unwrap_or_else(|e| e.into_inner())))
    }

    fn rng(seed: u64) -> StdRng {
        StdRng::seed_from_u64(seed)
    }

    fn rand_vec(r: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| r.gen_range(-1.0f32..1.0) * scale).collect()
    }

    /// max |got - want| / max |want| within `tol` (want must not be all zeros).
    fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        let norm = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
        assert!(norm > 0.0, "{what}: reference is all zeros");
        let mut worst = (0.0f64, 0usize);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let e = (*g as f64 - w).abs();
            if e.is_nan() || e > worst.0 {
                worst = (if e.is_nan() { f64::INFINITY } else { e }, i);
            }
        }
        let rel = worst.0 / norm;
        assert!(
            rel <= tol,
            "{what}: relative error {rel:e} > {tol:e} at {} (got {}, want {})",
            worst.1,
            got[worst.1],
            want[worst.1]
        );
    }

    #[test]
    fn rms_norm_matches_reference() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(1);
        for (rows, width) in [(3usize, 64usize), (5, 256), (2, 5000), (4, 8192)] {
            let x = rand_vec(&mut r, rows * width, 3.0);
            let w = rand_vec(&mut r, width, 1.0);
            let eps = 1e-6f32;
            let want: Vec<f64> = x
                .chunks(width)
                .flat_map(|row| {
                    let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / width as f64;
                    let inv = 1.0 / (ms + eps as f64).sqrt();
                    row.iter()
                        .zip(&w)
                        .map(move |(&v, &wi)| v as f64 * inv * wi as f64)
                        .collect::<Vec<_>>()
                })
                .collect();
            let dx = g.upload(&x).unwrap();
            let dw = g.upload(&w).unwrap();
            let mut out = g.zeros::<f32>(x.len()).unwrap();
            g.rms_norm(&dx, &dw, &mut out, eps).unwrap();
            assert_close(
                &g.download(&out).unwrap(),
                &want,
                1e-5,
                &format!("rms_norm {rows}x{width}"),
            );
            let mut dx = dx;
            g.rms_norm_in_place(&mut dx, &dw, eps).unwrap();
            assert_close(&g.download(&dx).unwrap(), &want, 1e-5, "rms_norm in place");
        }
        let dx = g.upload(&[1.0f32; 10]).unwrap();
        let dw = g.upload(&[1.0f32; 4]).unwrap();
        let mut out = g.zeros::<f32>(10).unwrap();
        assert!(matches!(
            g.rms_norm(&dx, &dw, &mut out, 1e-6),
            Err(CudaError::Shape(_))
        ));
    }

    /// An MLP activation in f64, as PyTorch defines it.
    fn activation_ref(act: Activation, a: f64) -> f64 {
        match act {
            Activation::Silu => a / (1.0 + (-a).exp()),
            Activation::GeluTanh => {
                let k = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * a * (1.0 + (k * (a + 0.044715 * a * a * a)).tanh())
            }
            Activation::GeluErf => 0.5 * a * (1.0 + libm::erf(a / std::f64::consts::SQRT_2)),
            Activation::Relu => a.max(0.0),
        }
    }

    #[test]
    fn layer_norm_and_activate_match_reference() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(31);
        for (rows, width) in [(3usize, 64usize), (5, 768), (2, 5000)] {
            // Rows far from zero mean: the variance is of the centred values.
            let x: Vec<f32> = rand_vec(&mut r, rows * width, 3.0)
                .into_iter()
                .map(|v| v + 7.0)
                .collect();
            let w = rand_vec(&mut r, width, 1.0);
            let b = rand_vec(&mut r, width, 1.0);
            let eps = 1e-5f32;
            let want: Vec<f64> = x
                .chunks(width)
                .flat_map(|row| {
                    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
                    let var =
                        row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
                    let inv = 1.0 / (var + eps as f64).sqrt();
                    row.iter()
                        .zip(w.iter().zip(&b))
                        .map(move |(&v, (&wi, &bi))| {
                            (v as f64 - mean) * inv * wi as f64 + bi as f64
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            let (dx, dw, db) = (
                g.upload(&x).unwrap(),
                g.upload(&w).unwrap(),
                g.upload(&b).unwrap(),
            );
            let mut out = g.zeros::<f32>(x.len()).unwrap();
            g.layer_norm(&dx, (&dw, &db), &mut out, eps).unwrap();
            assert_close(
                &g.download(&out).unwrap(),
                &want,
                1e-5,
                &format!("layer_norm {rows}x{width}"),
            );
        }
        let (dx, dw) = (
            g.upload(&[1.0f32; 10]).unwrap(),
            g.upload(&[1.0f32; 4]).unwrap(),
        );
        let mut out = g.zeros::<f32>(10).unwrap();
        assert!(matches!(
            g.layer_norm(&dx, (&dw, &dw), &mut out, 1e-5),
            Err(CudaError::Shape(_))
        ));

        let x = rand_vec(&mut r, 3000, 4.0);
        for act in [
            Activation::Silu,
            Activation::GeluTanh,
            Activation::GeluErf,
            Activation::Relu,
        ] {
            let mut dx = g.upload(&x).unwrap();
            g.activate(&mut dx, act).unwrap();
            let want: Vec<f64> = x.iter().map(|&a| activation_ref(act, a as f64)).collect();
            assert_close(
                &g.download(&dx).unwrap(),
                &want,
                1e-5,
                &format!("activate {act:?}"),
            );
        }
    }

    #[test]
    fn elementwise_kernels_match_reference() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(2);
        let (rows, w) = (7usize, 300usize);
        let n = rows * w;
        let x = rand_vec(&mut r, n, 4.0);
        let y = rand_vec(&mut r, n, 4.0);
        let bias = rand_vec(&mut r, w, 1.0);
        let f64s = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();

        let mut dx = g.upload(&x).unwrap();
        let dy = g.upload(&y).unwrap();
        g.add_in_place(&mut dx, &dy).unwrap();
        let want: Vec<f64> = x
            .iter()
            .zip(&y)
            .map(|(&a, &b)| a as f64 + b as f64)
            .collect();
        assert_close(&g.download(&dx).unwrap(), &want, 1e-6, "add_in_place");

        let mut dx = g.upload(&x).unwrap();
        let db = g.upload(&bias).unwrap();
        g.add_bias(&mut dx, &db).unwrap();
        let want: Vec<f64> = x
            .iter()
            .enumerate()
            .map(|(i, &a)| a as f64 + bias[i % w] as f64)
            .collect();
        assert_close(&g.download(&dx).unwrap(), &want, 1e-6, "add_bias");

        for act in [
            Activation::Silu,
            Activation::GeluTanh,
            Activation::GeluErf,
            Activation::Relu,
        ] {
            let mut dg = g.upload(&x).unwrap();
            g.act_mul(&mut dg, &dy, act).unwrap();
            let want: Vec<f64> = x
                .iter()
                .zip(&y)
                .map(|(&a, &b)| activation_ref(act, a as f64) * b as f64)
                .collect();
            assert_close(
                &g.download(&dg).unwrap(),
                &want,
                1e-5,
                &format!("act_mul {act:?}"),
            );
        }

        let mut dx = g.upload(&x).unwrap();
        g.scale(&mut dx, 0.37).unwrap();
        let want: Vec<f64> = f64s(&x).iter().map(|a| a * 0.37f32 as f64).collect();
        assert_close(&g.download(&dx).unwrap(), &want, 1e-6, "scale");

        let mut dx = g.upload(&x).unwrap();
        g.soft_cap(&mut dx, 2.5).unwrap();
        let want: Vec<f64> = f64s(&x).iter().map(|a| 2.5 * (a / 2.5).tanh()).collect();
        assert_close(&g.download(&dx).unwrap(), &want, 1e-5, "soft_cap");
        assert!(matches!(g.soft_cap(&mut dx, 0.0), Err(CudaError::Shape(_))));
        assert!(matches!(
            g.add_in_place(&mut dx, &db),
            Err(CudaError::Shape(_))
        ));
    }

    #[test]
    fn rope_matches_reference_in_both_pair_layouts() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(3);
        let (tokens, heads, d) = (5usize, 3usize, 64usize);
        for half in [16usize, 32] {
            for adjacent in [false, true] {
                let x = rand_vec(&mut r, tokens * heads * d, 2.0);
                let angles: Vec<f32> = (0..tokens * half)
                    .map(|_| r.gen_range(0.0f32..6.3))
                    .collect();
                let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
                let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
                let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
                for t in 0..tokens {
                    for h in 0..heads {
                        let base = (t * heads + h) * d;
                        for i in 0..half {
                            let (a, b) = if adjacent {
                                (2 * i, 2 * i + 1)
                            } else {
                                (i, i + half)
                            };
                            let (c, s) = (cos[t * half + i] as f64, sin[t * half + i] as f64);
                            let (x0, x1) = (x[base + a] as f64, x[base + b] as f64);
                            want[base + a] = x0 * c - x1 * s;
                            want[base + b] = x0 * s + x1 * c;
                        }
                    }
                }
                let mut dx = g.upload(&x).unwrap();
                let dc = g.upload(&cos).unwrap();
                let ds = g.upload(&sin).unwrap();
                g.rope(&mut dx, &dc, &ds, heads, d, half, adjacent).unwrap();
                assert_close(
                    &g.download(&dx).unwrap(),
                    &want,
                    1e-6,
                    &format!("rope half {half} adjacent {adjacent}"),
                );
            }
        }
    }

    #[test]
    fn embed_gather_scatter_and_cast() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(4);
        let (vocab, hidden) = (50usize, 96usize);
        let table = rand_vec(&mut r, vocab * hidden, 1.0);
        let ids: Vec<u32> = (0..9).map(|_| r.gen_range(0..vocab as u32)).collect();
        let scale = 1.5f32;
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|&id| table[id as usize * hidden..][..hidden].to_vec())
            .map(|v| v as f64)
            .collect();
        let did = g.upload(&ids).unwrap();
        let mut out = g.zeros::<f32>(ids.len() * hidden).unwrap();
        g.embed(&g.upload(&table).unwrap(), &did, &mut out, hidden, scale)
            .unwrap();
        let want_scaled: Vec<f64> = want.iter().map(|v| v * scale as f64).collect();
        assert_close(&g.download(&out).unwrap(), &want_scaled, 1e-7, "embed f32");
        let tb: Vec<bf16> = table.iter().map(|&v| bf16::from_f32(v)).collect();
        g.embed(&g.upload(&tb).unwrap(), &did, &mut out, hidden, 1.0)
            .unwrap();
        let want_b: Vec<f64> = ids
            .iter()
            .flat_map(|&id| tb[id as usize * hidden..][..hidden].to_vec())
            .map(|v| v.to_f32() as f64)
            .collect();
        assert_close(&g.download(&out).unwrap(), &want_b, 0.0, "embed bf16");

        // gather: rows of x in a random order, some repeated.
        let (rows, w) = (20usize, 70usize);
        let x = rand_vec(&mut r, rows * w, 1.0);
        let idx: Vec<u32> = (0..13).map(|_| r.gen_range(0..rows as u32)).collect();
        let mut out = g.zeros::<f32>(idx.len() * w).unwrap();
        g.gather_rows(
            &g.upload(&x).unwrap(),
            &g.upload(&idx).unwrap(),
            &mut out,
            w,
        )
        .unwrap();
        let want: Vec<f64> = idx
            .iter()
            .flat_map(|&i| x[i as usize * w..][..w].to_vec())
            .map(|v| v as f64)
            .collect();
        assert_close(&g.download(&out).unwrap(), &want, 0.0, "gather_rows");

        // scatter: rows of x to addresses inside one buffer, some entries empty.
        use lantern_cuda::cudarc::driver::DevicePtr;
        let dst_rows = 10usize;
        let out = g.zeros::<f32>(dst_rows * w).unwrap();
        let base = out.device_ptr(g.stream()).0;
        let mut want = vec![0f64; dst_rows * w];
        let mut table = Vec::new();
        for (slot, src) in [(7usize, 3usize), (0, 19), (4, 3), (9, 0), (2, 11)] {
            table.extend([base + (slot * w * 4) as u64, src as u64]);
            for (o, &v) in want[slot * w..][..w].iter_mut().zip(&x[src * w..][..w]) {
                *o = v as f64;
            }
        }
        table.splice(4..4, [0, 5]);
        table.extend([0, 0]);
        // SAFETY: every destination is a row inside `out`, alive until the download.
        unsafe { g.scatter_rows(&g.upload(&x).unwrap(), &g.upload(&table).unwrap(), w) }.unwrap();
        assert_close(&g.download(&out).unwrap(), &want, 0.0, "scatter_rows");

        // cast: bit-exact round to nearest even, specials included.
        let mut x = rand_vec(&mut r, 4000, 100.0);
        x.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            -3e-39,
            f32::MAX,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
        ]);
        let mut out = g.zeros::<bf16>(x.len()).unwrap();
        g.cast_f32_to_bf16(&g.upload(&x).unwrap(), &mut out)
            .unwrap();
        let got: Vec<u16> = g
            .download(&out)
            .unwrap()
            .iter()
            .map(|b| b.to_bits())
            .collect();
        let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        assert_eq!(got, want, "cast_f32_to_bf16");
    }

    /// `reduce_rows` on the device, its parameters and words as lantern-cuda's
    /// `reduce` module writes and reads them.
    fn reduce(g: &Gpu, x: &[f32], wants: &[RowReduction]) -> Vec<ReducedRow> {
        let cap = MAX_REDUCED_TOP_LOGPROBS;
        let params: Vec<u32> = wants.iter().flat_map(reduce::reduce_params).collect();
        let stride = reduce::reduce_stride(cap);
        let mut out = g.zeros::<u32>(wants.len() * stride).unwrap();
        g.reduce_rows(
            &g.upload(x).unwrap(),
            &g.upload(&params).unwrap(),
            &mut out,
            cap,
        )
        .unwrap();
        let words = g.download(&out).unwrap();
        words
            .chunks_exact(stride)
            .zip(wants)
            .map(|(w, want)| reduce::reduced_row(w, want))
            .collect()
    }

    fn want(token: TokenChoice, logprobs: Option<usize>) -> RowReduction {
        RowReduction { token, logprobs }
    }

    /// Rows reduced on the device as lantern-model's `reduce_row` reduces them: argmax
    /// (ties to the first), samples (the draw's interval of the cumulative softmax), given
    /// tokens, and their logprobs, ranks and top alternatives.
    #[test]
    fn reduced_rows_follow_the_reference() {
        let Some((g, _turn)) = gpu() else { return };
        let mut r = rng(23);

        // argmax with planted ties: the first index wins.
        let (rows, n) = (6usize, 5000usize);
        let mut x = rand_vec(&mut r, rows * n, 1.0);
        let mut expected = Vec::new();
        for row in 0..rows {
            let a = r.gen_range(0..n - 1);
            let b = r.gen_range(a + 1..n);
            x[row * n + a] = 2.0;
            x[row * n + b] = 2.0;
            expected.push(a as u32);
        }
        let got: Vec<u32> = reduce(&g, &x, &vec![want(TokenChoice::Argmax, None); rows])
            .iter()
            .map(|r| r.token)
            .collect();
        assert_eq!(got, expected, "argmax");

        // Argmax rows and sampled rows in one launch. A sampled row's token is the one
        // whose interval of the cumulative softmax (in id order, f64) holds the draw, up to
        // the f32 sums' rounding: the host reference's token, or a neighbour of it when the
        // draw falls on the boundary between them.
        let (rows, n) = (64usize, 5000usize);
        let x = rand_vec(&mut r, rows * n, 4.0);
        let draws: Vec<Option<SampleDraw>> = (0..rows)
            .map(|i| {
                (i % 4 != 0)
                    .then(|| SampleDraw::whole(r.gen_range(0.0..1.0), [1.0, 0.5, 2.0][i % 3]))
            })
            .collect();
        let wants: Vec<RowReduction> = draws
            .iter()
            .map(|d| want(d.map_or(TokenChoice::Argmax, TokenChoice::Sample), None))
            .collect();
        let got = reduce(&g, &x, &wants);
        let mut exact = 0;
        for (row, (reduced, draw)) in got.iter().zip(&draws).enumerate() {
            let token = reduced.token;
            assert_eq!(reduced.score, None, "row {row}: not scored");
            let values = &x[row * n..][..n];
            let Some(d) = draw else {
                assert_eq!(token, pick::first_max(values), "row {row}: argmax");
                continue;
            };
            let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let w: Vec<f64> = values
                .iter()
                .map(|&v| ((v as f64 - max) * d.inv_temperature as f64).exp())
                .collect();
            let total: f64 = w.iter().sum();
            let before: f64 = w[..token as usize].iter().sum::<f64>() / total;
            let after = before + w[token as usize] / total;
            let u = d.draw as f64;
            assert!(
                before <= u + 1e-5 && u - 1e-5 <= after,
                "row {row}: token {token} covers [{before}, {after}), the draw is {u}"
            );
            exact += usize::from(token == pick::sample_row(values, *d));
        }
        assert!(
            exact + 2 >= rows * 3 / 4,
            "{exact} sampled rows as the reference"
        );

        // Sampled rows cut by top-k, top-p and min-p (alone and together, on flat and
        // peaked rows, with ties at the cuts): the reference's token, or at a boundary of
        // the f32 sums a token the reference keeps too.
        let (rows, n) = (48usize, 6000usize);
        let mut x = rand_vec(&mut r, rows * n, 1.0);
        for (row, chunk) in x.chunks_exact_mut(n).enumerate() {
            let spread = [1.0f32, 4.0, 12.0][row % 3];
            chunk.iter_mut().for_each(|v| *v *= spread);
            if row % 4 == 1 {
                // Ties among the most likely tokens.
                let top = chunk.iter().copied().fold(f32::MIN, f32::max);
                for j in [5, 900, 4100, 5999] {
                    chunk[j] = top;
                }
            }
        }
        let cuts = [
            (1usize, 1.0f32, 0.0f32),
            (2, 1.0, 0.0),
            (40, 1.0, 0.0),
            (0, 0.9, 0.0),
            (0, 0.5, 0.0),
            (0, 1.0, 0.05),
            (50, 0.8, 0.01),
            (5999, 0.95, 0.0),
        ];
        let draws: Vec<SampleDraw> = (0..rows)
            .map(|i| {
                let (top_k, top_p, min_p) = cuts[i % cuts.len()];
                SampleDraw {
                    top_k,
                    top_p,
                    min_p,
                    ..SampleDraw::whole(r.gen_range(0.0..1.0), [1.0, 0.7][i % 2])
                }
            })
            .collect();
        let wants: Vec<RowReduction> = draws
            .iter()
            .map(|&d| want(TokenChoice::Sample(d), None))
            .collect();
        let got = reduce(&g, &x, &wants);
        let mut exact = 0;
        for (row, (reduced, d)) in got.iter().zip(&draws).enumerate() {
            let values = &x[row * n..][..n];
            let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let weights: Vec<f32> = values
                .iter()
                .map(|&v| ((v - max) * d.inv_temperature).exp())
                .collect();
            let floor = pick::cut_weight(&weights, d);
            let token = reduced.token as usize;
            assert!(
                weights[token] >= floor * (1.0 - 1e-4),
                "row {row} ({d:?}): token {token} of weight {} under the cut {floor}",
                weights[token]
            );
            if d.top_k <= 2 && d.top_k > 0 && d.top_p == 1.0 {
                // Ties at the cut all kept (five tied tokens lead the tie rows).
                let kept = weights.iter().filter(|&&w| w >= floor).count();
                let ties = values.iter().filter(|&&v| v == max).count();
                let want_kept = ties.max(d.top_k);
                assert_eq!(kept, want_kept, "row {row}: top-{}", d.top_k);
            }
            exact += usize::from(reduced.token == pick::sample_row(values, *d));
        }
        assert!(
            exact + 3 >= rows,
            "{exact} of {rows} cut rows as the reference"
        );

        // Scored rows of every kind, vocabularies small and large, 0 to the most
        // alternatives: the reference's ranks and top ids exactly, logprobs to f32 sums.
        for (rows, n) in [(40usize, 5000usize), (6, 151_936), (8, 7)] {
            let mut x = rand_vec(&mut r, rows * n, 6.0);
            // Planted ties among the largest (ties go to the lower id).
            if n > 100 {
                for row in (0..rows).step_by(3) {
                    let top = x[row * n..][..n].iter().copied().fold(f32::MIN, f32::max);
                    for j in [n / 3, n / 7, n - 1] {
                        x[row * n + j] = top + 0.5;
                    }
                }
            }
            let wants: Vec<RowReduction> = (0..rows)
                .map(|i| {
                    let token = match i % 3 {
                        0 => TokenChoice::Argmax,
                        1 => TokenChoice::Sample(SampleDraw::whole(r.gen_range(0.0..1.0), 0.8)),
                        _ => TokenChoice::Given(r.gen_range(0..n as u32)),
                    };
                    let k = [0, 1, 5, MAX_REDUCED_TOP_LOGPROBS][i % 4];
                    want(token, Some(k))
                })
                .collect();
            let got = reduce(&g, &x, &wants);
            for (row, (reduced, w)) in got.iter().zip(&wants).enumerate() {
                let what = format!("{n} ids, row {row}");
                let values = &x[row * n..][..n];
                if let TokenChoice::Given(t) = w.token {
                    assert_eq!(reduced.token, t, "{what}: given token");
                } else if w.token == TokenChoice::Argmax {
                    assert_eq!(reduced.token, pick::first_max(values), "{what}: argmax");
                }
                let score = reduced.score.as_ref().expect("scored");
                let reference = pick::score_token(values, reduced.token, w.logprobs.unwrap());
                assert_eq!(score.rank, reference.rank, "{what}: rank");
                let ids = |s: &RowScore| s.top.iter().map(|t| t.0).collect::<Vec<_>>();
                assert_eq!(ids(score), ids(&reference), "{what}: top ids");
                let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 + 1e-5 * b.abs();
                assert!(
                    close(score.logprob, reference.logprob),
                    "{what}: logprob {} against {}",
                    score.logprob,
                    reference.logprob
                );
                for (a, b) in score.top.iter().zip(&reference.top) {
                    assert!(close(a.1, b.1), "{what}: top logprob {a:?} against {b:?}");
                }
            }
        }

        // Edits (penalties, bias, suppressed tokens) bit for bit as the reference applies
        // them, padding edits of no row doing nothing.
        let (rows, n) = (5usize, 3000usize);
        let x = rand_vec(&mut r, rows * n, 5.0);
        let mut edits = Vec::new();
        for row in 0..rows as u32 {
            let mut tokens: Vec<u32> = (0..n as u32).collect();
            for i in 0..200 {
                let t = tokens.swap_remove(r.gen_range(0..tokens.len()));
                edits.push(LogitEdit {
                    row,
                    token: t,
                    repetition: [1.0, 1.3, 0.7][i % 3],
                    subtract: [0.0, 0.45, -1.5][i % 5 % 3],
                    add: [0.0, 2.0][i % 2],
                    suppress: i % 17 == 0,
                });
            }
        }
        edits.push(LogitEdit {
            row: u32::MAX,
            token: 0,
            repetition: 2.0,
            subtract: 1.0,
            add: 1.0,
            suppress: true,
        });
        let mut edited = x.clone();
        pick::apply_edits(&mut edited, n, &edits);
        let mut on_device = g.upload(&x).unwrap();
        g.edit_logits(
            &mut on_device,
            n,
            &g.upload(&reduce::edit_words(&edits)).unwrap(),
        )
        .unwrap();
        let got = g.download(&on_device).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&got) == bits(&edited), "edit_logits: rows differ");
        assert!(got != x, "edits changed the rows");

        // A row with few numbers (NaN elsewhere) and -inf: the top stops at its numbers.
        let mut x = vec![f32::NAN; 64];
        x[9] = 1.0;
        x[3] = f32::NEG_INFINITY;
        x[40] = 1.0;
        x[17] = -2.0;
        let got = reduce(&g, &x, &[want(TokenChoice::Given(17), Some(10))]);
        let score = got[0].score.as_ref().unwrap();
        let reference = pick::score_token(&x, 17, 10);
        assert_eq!(score.rank, 3, "two logits above -2");
        let ids = |s: &RowScore| s.top.iter().map(|t| t.0).collect::<Vec<_>>();
        assert_eq!(ids(score), vec![9, 40, 17, 3]);
        assert_eq!(ids(score), ids(&reference));
        assert!((score.logprob - reference.logprob).abs() < 1e-6);
        assert_eq!(score.top[3].1, f32::NEG_INFINITY);
    }

    #[test]
    fn gemms_match_reference() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(5);
        for (m, n, k) in [(1usize, 33usize, 64usize), (7, 96, 256), (64, 130, 512)] {
            let x = rand_vec(&mut r, m * k, 1.0);
            let w = rand_vec(&mut r, n * k, 1.0);
            let reference = |x: &[f32], w: &[f32]| -> Vec<f64> {
                let mut y = vec![0.0f64; m * n];
                for i in 0..m {
                    for j in 0..n {
                        y[i * n + j] = (0..k)
                            .map(|l| x[i * k + l] as f64 * w[j * k + l] as f64)
                            .sum();
                    }
                }
                y
            };
            let mut y = g.zeros::<f32>(m * n).unwrap();
            g.gemm_f32(
                &g.upload(&x).unwrap(),
                &g.upload(&w).unwrap(),
                &mut y,
                m,
                n,
                k,
            )
            .unwrap();
            assert_close(
                &g.download(&y).unwrap(),
                &reference(&x, &w),
                1e-6,
                &format!("gemm_f32 {m}x{n}x{k}"),
            );

            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            g.gemm_bf16(
                &g.upload(&xb).unwrap(),
                &g.upload(&wb).unwrap(),
                &mut y,
                m,
                n,
                k,
            )
            .unwrap();
            assert_close(
                &g.download(&y).unwrap(),
                &reference(&xr, &wr),
                1e-5,
                &format!("gemm_bf16 {m}x{n}x{k}"),
            );
        }
        let x = g.zeros::<f32>(10).unwrap();
        let mut y = g.zeros::<f32>(4).unwrap();
        assert!(matches!(
            g.gemm_f32(&x, &x, &mut y, 2, 2, 4),
            Err(CudaError::Shape(_))
        ));
    }

    const NUM_BLOCKS: usize = 200;

    fn layouts(
        num_blocks: usize,
        bs: usize,
        kvh: usize,
        d: usize,
    ) -> [(&'static str, KvStrides); 2] {
        [
            ("kv_first", KvStrides::kv_first(num_blocks, bs, kvh, d)),
            ("block_first", KvStrides::block_first(bs, kvh, d)),
        ]
    }

    fn kv_write_case<T: CacheElem + PartialEq + std::fmt::Debug>(g: &Gpu, r: &mut StdRng) {
        let (bs, kvh, d) = (16usize, 2usize, 64usize);
        for (name, s) in layouts(NUM_BLOCKS, bs, kvh, d) {
            let len = s.cache_len(NUM_BLOCKS);
            let t = 40;
            let k = rand_vec(r, t * kvh * d, 1.0);
            let v = rand_vec(r, t * kvh * d, 1.0);
            let mut pool: Vec<i64> = (0..(NUM_BLOCKS * bs) as i64).collect();
            let slots: Vec<i64> = (0..t)
                .map(|_| {
                    if r.gen_bool(0.2) {
                        -1
                    } else {
                        pool.swap_remove(r.gen_range(0..pool.len()))
                    }
                })
                .collect();
            let sentinel = T::from_f32(7.0);
            let mut want = vec![sentinel; len];
            for (ti, &slot) in slots.iter().enumerate() {
                if slot < 0 {
                    continue;
                }
                for h in 0..kvh {
                    for i in 0..d {
                        let off = s.key_offset(slot as usize, h, i);
                        want[off] = T::from_f32(k[(ti * kvh + h) * d + i]);
                        want[off + s.kv] = T::from_f32(v[(ti * kvh + h) * d + i]);
                    }
                }
            }
            let mut cache = g.upload(&vec![sentinel; len]).unwrap();
            g.kv_write(
                &g.upload(&k).unwrap(),
                &g.upload(&v).unwrap(),
                &g.upload(&slots).unwrap(),
                &mut cache,
                &s,
            )
            .unwrap();
            let got = g.download(&cache).unwrap();
            assert!(got == want, "kv_write {} {name}", T::SUFFIX);
        }
    }

    /// `rope_kv_write` against `rope_qk` then `kv_write`: the same cache and queries, bit
    /// for bit, in both cache layouts and pair layouts, with partial rotary dims, grouped
    /// queries and skipped slots; k itself left as it was.
    fn rope_kv_write_case<T: CacheElem + PartialEq + std::fmt::Debug>(g: &Gpu, r: &mut StdRng) {
        let (bs, kvh, d, q_heads, t) = (16usize, 2usize, 64usize, 6usize, 24usize);
        for (name, s) in layouts(NUM_BLOCKS, bs, kvh, d) {
            for (half, adjacent) in [(32usize, false), (32, true), (8, false)] {
                let what = format!("{} {name} half {half} adjacent {adjacent}", T::SUFFIX);
                let len = s.cache_len(NUM_BLOCKS);
                let q = rand_vec(r, t * q_heads * d, 2.0);
                let k = rand_vec(r, t * kvh * d, 2.0);
                let v = rand_vec(r, t * kvh * d, 1.0);
                let angles: Vec<f32> = (0..t * half).map(|_| r.gen_range(0.0f32..6.3)).collect();
                let cos = g
                    .upload(&angles.iter().map(|a| a.cos()).collect::<Vec<_>>())
                    .unwrap();
                let sin = g
                    .upload(&angles.iter().map(|a| a.sin()).collect::<Vec<_>>())
                    .unwrap();
                let mut pool: Vec<i64> = (0..(NUM_BLOCKS * bs) as i64).collect();
                let slots: Vec<i64> = (0..t)
                    .map(|_| {
                        if r.gen_bool(0.2) {
                            -1
                        } else {
                            pool.swap_remove(r.gen_range(0..pool.len()))
                        }
                    })
                    .collect();
                let slots = g.upload(&slots).unwrap();
                let dv = g.upload(&v).unwrap();
                let sentinel = T::from_f32(7.0);

                let (mut q1, mut k1) = (g.upload(&q).unwrap(), g.upload(&k).unwrap());
                let mut cache1 = g.upload(&vec![sentinel; len]).unwrap();
                g.rope_qk(
                    (&mut q1, q_heads),
                    (&mut k1, kvh),
                    &cos,
                    &sin,
                    d,
                    half,
                    adjacent,
                )
                .unwrap();
                g.kv_write(&k1, &dv, &slots, &mut cache1, &s).unwrap();

                let (mut q2, k2) = (g.upload(&q).unwrap(), g.upload(&k).unwrap());
                let mut cache2 = g.upload(&vec![sentinel; len]).unwrap();
                let rope = RopeStep {
                    cos: &cos,
                    sin: &sin,
                    half,
                    adjacent,
                };
                g.rope_kv_write((&mut q2, q_heads), &k2, &dv, &rope, &slots, &mut cache2, &s)
                    .unwrap();

                let cache = g.download(&cache2).unwrap();
                assert!(cache == g.download(&cache1).unwrap(), "cache, {what}");
                assert!(
                    cache.iter().any(|c| *c != sentinel),
                    "something written, {what}"
                );
                assert_eq!(
                    g.download(&q2).unwrap(),
                    g.download(&q1).unwrap(),
                    "q, {what}"
                );
                assert_ne!(g.download(&q2).unwrap(), q, "q turned, {what}");
                assert_eq!(g.download(&k2).unwrap(), k, "k left as it was, {what}");
            }
        }
        // Query heads that are no multiple of the kv heads are refused, not launched.
        let mut q = g.upload(&vec![0.0f32; 5 * d]).unwrap();
        let kv = g.upload(&vec![0.0f32; kvh * d]).unwrap();
        let one = g.upload(&[0.5f32; 32]).unwrap();
        let rope = RopeStep {
            cos: &one,
            sin: &one,
            half: 32,
            adjacent: false,
        };
        let (slots, s) = (
            g.upload(&[0i64]).unwrap(),
            KvStrides::block_first(bs, kvh, d),
        );
        let mut cache = g.upload(&vec![T::from_f32(0.0); s.cache_len(1)]).unwrap();
        assert!(matches!(
            g.rope_kv_write((&mut q, 5), &kv, &kv, &rope, &slots, &mut cache, &s),
            Err(CudaError::Shape(_))
        ));
    }

    #[test]
    fn rope_kv_write_equals_rope_then_kv_write() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(61);
        rope_kv_write_case::<bf16>(&g, &mut r);
        rope_kv_write_case::<f16>(&g, &mut r);
        rope_kv_write_case::<f32>(&g, &mut r);
    }

    /// A driver that refuses programmatic dependent launches (the emulator with
    /// `LANTERN_CUDA_EMULATOR_PDL=refuse`, which scripts/test-gpu-emulated runs this test
    /// with too) costs the overlap, not the kernels: they run plainly, with the same
    /// results, and the device says it no longer overlaps them.
    #[test]
    fn refused_overlapped_launches_fall_back_to_plain_ones() {
        let Some((g, _t)) = gpu() else { return };
        let refused = std::env::var("LANTERN_CUDA_EMULATOR_PDL").as_deref() == Ok("refuse");
        let mut x = g.upload(&[1.5f32; 300]).unwrap();
        let y = g.upload(&[0.25f32; 300]).unwrap();
        for _ in 0..2 {
            g.add_in_place(&mut x, &y).unwrap();
        }
        assert_eq!(g.download(&x).unwrap(), vec![2.0f32; 300]);
        if refused {
            assert!(
                !g.launches_overlap(),
                "refused: plain launches from then on"
            );
        } else if g.compute_capability().0 >= 9 && std::env::var("LANTERN_CUDA_PDL").is_err() {
            assert!(g.launches_overlap(), "sm_90 and later overlap launches");
        }
    }

    /// Once asked, every eager launch and cuBLAS product is timed and counted by name.
    #[test]
    fn kernel_times_count_each_launch_by_name() {
        let Some((g, _t)) = gpu() else { return };
        let before = |name: &str| -> u64 {
            g.kernel_times()
                .unwrap()
                .unwrap_or_default()
                .iter()
                .find(|t| t.name == name)
                .map_or(0, |t| t.launches)
        };
        g.time_kernels();
        let (adds, gemms) = (before("add_in_place"), before("cublas_gemm_f32"));
        let mut x = g.upload(&[1.0f32; 64]).unwrap();
        let y = g.upload(&[2.0f32; 64]).unwrap();
        for _ in 0..3 {
            g.add_in_place(&mut x, &y).unwrap();
        }
        let mut out = g.zeros::<f32>(4).unwrap();
        g.gemm_f32(&x, &y, &mut out, 2, 2, 32).unwrap();
        let times = g.kernel_times().unwrap().expect("timing was asked for");
        let of = |name: &str| times.iter().find(|t| t.name == name).expect(name);
        assert_eq!(of("add_in_place").launches, adds + 3);
        assert_eq!(of("cublas_gemm_f32").launches, gemms + 1);
        assert!(times.iter().all(|t| t.seconds >= 0.0 && t.launches > 0));
        assert!(
            times.windows(2).all(|w| w[0].seconds >= w[1].seconds),
            "longest first"
        );
        assert_eq!(g.download(&x).unwrap()[0], 7.0);
    }

    #[test]
    fn kv_write_fills_both_layouts_and_skips_negative_slots() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(6);
        kv_write_case::<bf16>(&g, &mut r);
        kv_write_case::<f16>(&g, &mut r);
        kv_write_case::<f32>(&g, &mut r);
    }

    #[derive(Clone, Copy, Debug)]
    struct Variant {
        window: Option<usize>,
        chunk: Option<usize>,
        cap: Option<f32>,
        sinks: bool,
    }

    const BASE: Variant = Variant {
        window: None,
        chunk: None,
        cap: None,
        sinks: false,
    };

    /// The batches attention is tested on.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Batch {
        /// Six requests: decodes and prefill chunks over contexts of up to 300 keys.
        Mixed,
        /// One to four decodes over 1000..=3000 keys (the third, if any, over at most 40).
        LongDecode,
    }

    /// Key splits every attention case also runs through `paged_attention_split`.
    const SPLITS: [usize; 5] = [1, 2, 3, 7, 16];

    /// One random batch through `paged_attention` (automatic path), the plain kernel and
    /// the split path with each of `SPLITS`, against a naive softmax over the visible keys
    /// read from the same cache; the split outputs also against the plain kernel's.
    fn attention_case<T: CacheElem>(
        g: &Gpu,
        r: &mut StdRng,
        heads: usize,
        kvh: usize,
        d: usize,
        variant: Variant,
        batch: Batch,
    ) {
        let bs = 16usize;
        let mut qlens = Vec::new();
        let mut seqs = Vec::new();
        match batch {
            Batch::Mixed => {
                for i in 0..6 {
                    let q = if i % 2 == 0 { 1 } else { r.gen_range(1..=40) };
                    qlens.push(q);
                    seqs.push(q + r.gen_range(0..=260));
                }
            }
            Batch::LongDecode => {
                for i in 0..r.gen_range(1..=4) {
                    qlens.push(1);
                    seqs.push(if i == 2 {
                        r.gen_range(1..=40)
                    } else {
                        r.gen_range(1000..=3000)
                    });
                }
            }
        }
        let num_reqs = qlens.len();
        let num_blocks =
            NUM_BLOCKS.max(seqs.iter().map(|s: &usize| s.div_ceil(bs)).sum::<usize>() + 8);
        let padding = 2usize;
        let t_real: usize = qlens.iter().sum();
        let t = t_real + padding;
        let mut qsl = vec![0u32];
        for q in &qlens {
            qsl.push(qsl.last().unwrap() + *q as u32);
        }
        let stride = seqs.iter().map(|s| s.div_ceil(bs)).max().unwrap() + 1;
        let mut free: Vec<u32> = (0..num_blocks as u32).collect();
        let mut table = vec![u32::MAX; num_reqs * stride];
        // The first key any query of request `ri` sees.
        let first_visible = |ri: usize| -> usize {
            let p = seqs[ri] - qlens[ri];
            let mut lo = 0usize;
            if let Some(w) = variant.window {
                lo = lo.max((p + 1).saturating_sub(w));
            }
            if let Some(c) = variant.chunk {
                lo = lo.max(p / c * c);
            }
            lo
        };
        for ri in 0..num_reqs {
            for b in first_visible(ri) / bs..seqs[ri].div_ceil(bs) {
                table[ri * stride + b] = free.swap_remove(r.gen_range(0..free.len()));
            }
        }
        for (name, s) in layouts(num_blocks, bs, kvh, d) {
            let len = s.cache_len(num_blocks);
            let cache_host: Vec<T> = (0..len)
                .map(|_| T::from_f32(r.gen_range(-1.0f32..1.0)))
                .collect();
            let q = rand_vec(r, t * heads * d, 1.0);
            let sinks: Vec<f32> = (0..heads).map(|_| r.gen_range(-1.0f32..3.0)).collect();
            let scale = if variant.cap.is_some() {
                1.5
            } else {
                1.0 / (d as f32).sqrt()
            };

            let mut want = vec![0.0f64; t * heads * d];
            for ri in 0..num_reqs {
                for i in 0..qlens[ri] {
                    let tok = qsl[ri] as usize + i;
                    let p = seqs[ri] - qlens[ri] + i;
                    for h in 0..heads {
                        let kh = h / (heads / kvh);
                        let qv = &q[(tok * heads + h) * d..][..d];
                        let mut keys = Vec::new();
                        for k in 0..=p {
                            if variant.window.is_some_and(|w| p - k >= w) {
                                continue;
                            }
                            if variant.chunk.is_some_and(|c| k / c != p / c) {
                                continue;
                            }
                            let slot = table[ri * stride + k / bs] as usize * bs + k % bs;
                            let mut logit = 0.0f64;
                            for j in 0..d {
                                logit += qv[j] as f64
                                    * cache_host[s.key_offset(slot, kh, j)].to_f32() as f64;
                            }
                            logit *= scale as f64;
                            if let Some(c) = variant.cap {
                                logit = c as f64 * (logit / c as f64).tanh();
                            }
                            keys.push((slot, logit));
                        }
                        let mut mx = keys.iter().fold(f64::NEG_INFINITY, |m, &(_, l)| m.max(l));
                        if variant.sinks {
                            mx = mx.max(sinks[h] as f64);
                        }
                        let mut denom: f64 = keys.iter().map(|&(_, l)| (l - mx).exp()).sum();
                        if variant.sinks {
                            denom += (sinks[h] as f64 - mx).exp();
                        }
                        let o = &mut want[(tok * heads + h) * d..][..d];
                        for &(slot, l) in &keys {
                            let pk = (l - mx).exp() / denom;
                            for j in 0..d {
                                o[j] += pk
                                    * cache_host[s.key_offset(slot, kh, j) + s.kv].to_f32() as f64;
                            }
                        }
                    }
                }
            }

            let dq = g.upload(&q).unwrap();
            let mut dout = g.upload(&vec![f32::NAN; t * heads * d]).unwrap();
            let dcache = g.upload(&cache_host).unwrap();
            let dqsl = g.upload(&qsl).unwrap();
            let seq32: Vec<u32> = seqs.iter().map(|&s| s as u32).collect();
            let dseq = g.upload(&seq32).unwrap();
            let dtable = g.upload(&table).unwrap();
            let dsinks = g.upload(&sinks).unwrap();
            let meta = PagedMeta {
                query_start_loc: dqsl.as_view(),
                seq_lens: dseq.as_view(),
                block_table: dtable.as_view(),
                table_stride: stride,
                num_reqs,
                num_tokens: t,
                max_query_len: *qlens.iter().max().unwrap(),
                max_seq_len: *seqs.iter().max().unwrap(),
            };
            let spec = AttnParams {
                num_heads: heads,
                num_kv_heads: kvh,
                head_dim: d,
                scale,
                sliding_window: variant.window,
                chunk_size: variant.chunk,
                soft_cap: variant.cap,
                sinks: variant.sinks.then(|| dsinks.as_view()),
            };
            let what = format!(
                "paged_attention {} {name} heads {heads}/{kvh} d {d} {variant:?} {batch:?}",
                T::SUFFIX
            );
            let check = |got: &[f32], want: &[f64], tol: f64, what: &str| {
                for row in 0..t_real * heads {
                    assert_close(
                        &got[row * d..][..d],
                        &want[row * d..][..d],
                        tol,
                        &format!("{what} row {row}"),
                    );
                }
                assert!(
                    got[t_real * heads * d..].iter().all(|&v| v == 0.0),
                    "{what}: padding rows"
                );
            };
            g.paged_attention(&dq, &mut dout, &dcache, &s, &meta, &spec)
                .unwrap();
            check(&g.download(&dout).unwrap(), &want, 2e-5, &what);
            // The plain kernel (0), then each split count, on the same inputs.
            let mut plain = Vec::new();
            for splits in std::iter::once(0).chain(SPLITS) {
                dout = g.upload(&vec![f32::NAN; t * heads * d]).unwrap();
                g.paged_attention_split(&dq, &mut dout, &dcache, &s, &meta, &spec, splits)
                    .unwrap();
                let got = g.download(&dout).unwrap();
                let what = format!("{what} splits {splits}");
                check(&got, &want, 2e-5, &what);
                if splits == 0 {
                    plain = got.iter().map(|&v| v as f64).collect();
                } else {
                    check(
                        &got,
                        &plain,
                        1e-5,
                        &format!("{what} against the plain kernel"),
                    );
                }
            }
        }
    }

    /// Plain, window, chunk, soft cap, sinks, and window + soft cap + sinks.
    fn variants() -> [Variant; 6] {
        [
            BASE,
            Variant {
                window: Some(37),
                ..BASE
            },
            Variant {
                chunk: Some(64),
                ..BASE
            },
            Variant {
                cap: Some(5.0),
                ..BASE
            },
            Variant {
                sinks: true,
                ..BASE
            },
            Variant {
                window: Some(100),
                cap: Some(20.0),
                sinks: true,
                ..BASE
            },
        ]
    }

    fn attention_all<T: CacheElem>(g: &Gpu, seed: u64) {
        let mut r = rng(seed);
        let variants = variants();
        for v in variants {
            attention_case::<T>(g, &mut r, 4, 2, 64, v, Batch::Mixed);
        }
        for v in [variants[0], variants[5]] {
            attention_case::<T>(g, &mut r, 4, 2, 128, v, Batch::Mixed);
        }
    }

    #[test]
    fn paged_attention_bf16_cache() {
        let Some((g, _t)) = gpu() else { return };
        attention_all::<bf16>(&g, 10);
    }

    #[test]
    fn paged_attention_f16_cache() {
        let Some((g, _t)) = gpu() else { return };
        attention_all::<f16>(&g, 11);
    }

    #[test]
    fn paged_attention_f32_cache() {
        let Some((g, _t)) = gpu() else { return };
        attention_all::<f32>(&g, 12);
    }

    #[test]
    fn paged_attention_large_groups_and_head_dims() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(13);
        // 40 query heads on one kv head at d 128: the group is split over three blocks.
        attention_case::<bf16>(&g, &mut r, 40, 1, 128, BASE, Batch::Mixed);
        attention_case::<bf16>(
            &g,
            &mut r,
            16,
            2,
            256,
            Variant {
                sinks: true,
                ..BASE
            },
            Batch::Mixed,
        );
        attention_case::<f32>(
            &g,
            &mut r,
            7,
            7,
            80,
            Variant {
                window: Some(50),
                ..BASE
            },
            Batch::Mixed,
        );
    }

    /// Long-context decodes (the split-K path's case) at SmolLM2's heads (9 over 3) and a
    /// wider head_dim, every variant (windows and chunks scaled to the context), both layouts.
    fn long_decode_all<T: CacheElem>(g: &Gpu, seed: u64) {
        let mut r = rng(seed);
        let long = |v: Variant| Variant {
            window: v.window.map(|w| w * 20),
            chunk: v.chunk.map(|c| c * 16),
            ..v
        };
        for v in variants() {
            attention_case::<T>(g, &mut r, 9, 3, 64, long(v), Batch::LongDecode);
        }
        for v in [variants()[0], variants()[5]] {
            attention_case::<T>(g, &mut r, 8, 2, 128, long(v), Batch::LongDecode);
        }
    }

    #[test]
    fn paged_attention_split_long_decodes_bf16_cache() {
        let Some((g, _t)) = gpu() else { return };
        long_decode_all::<bf16>(&g, 14);
    }

    #[test]
    fn paged_attention_split_long_decodes_f32_cache() {
        let Some((g, _t)) = gpu() else { return };
        long_decode_all::<f32>(&g, 15);
    }

    /// The bf16 copy a fused kernel writes is the f32 output rounded to nearest even.
    fn assert_bf16_copy(out: &[f32], half: &[bf16], what: &str) {
        assert_eq!(out.len(), half.len(), "{what}: lengths");
        for (i, (&o, &h)) in out.iter().zip(half).enumerate() {
            assert_eq!(
                h.to_bits(),
                bf16::from_f32(o).to_bits(),
                "{what}: bf16 copy at {i}"
            );
        }
    }

    fn rms_reference(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
        let width = w.len();
        x.chunks(width)
            .flat_map(|row| {
                let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / width as f64;
                let inv = 1.0 / (ms + eps as f64).sqrt();
                row.iter()
                    .zip(w)
                    .map(move |(&v, &wi)| v as f64 * inv * wi as f64)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn fused_norms_match_reference_and_write_their_bf16_copy() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(21);
        for (rows, width) in [(1usize, 576usize), (5, 2048), (3, 5000)] {
            let x = rand_vec(&mut r, rows * width, 3.0);
            let delta = rand_vec(&mut r, rows * width, 2.0);
            let w = rand_vec(&mut r, width, 1.0);
            let eps = 1e-5f32;
            let name = format!("{rows}x{width}");
            let dw = g.upload(&w).unwrap();
            // The norm alone, with and without its copy; x is left as it was.
            let dx = g.upload(&x).unwrap();
            let mut out = g.zeros::<f32>(x.len()).unwrap();
            let mut half = g.zeros::<bf16>(x.len()).unwrap();
            g.rms_norm_twin(&dx, &dw, &mut out, Some(&mut half), eps)
                .unwrap();
            let got = g.download(&out).unwrap();
            assert_close(&got, &rms_reference(&x, &w, eps), 1e-5, &name);
            assert_bf16_copy(&got, &g.download(&half).unwrap(), &name);
            assert_eq!(g.download(&dx).unwrap(), x, "{name}: x untouched");
            let mut plain = g.zeros::<f32>(x.len()).unwrap();
            g.rms_norm_twin(&dx, &dw, &mut plain, None, eps).unwrap();
            assert_eq!(g.download(&plain).unwrap(), got, "{name}: without the copy");
            // Added first: x becomes x + delta (the same f32 additions as the host's).
            let mut dx = g.upload(&x).unwrap();
            let dd = g.upload(&delta).unwrap();
            g.add_rms_norm(&mut dx, &dd, &dw, &mut out, Some(&mut half), eps)
                .unwrap();
            let summed: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
            assert_eq!(g.download(&dx).unwrap(), summed, "{name}: x += delta");
            let got = g.download(&out).unwrap();
            assert_close(&got, &rms_reference(&summed, &w, eps), 1e-5, &name);
            assert_bf16_copy(&got, &g.download(&half).unwrap(), &name);
        }
        let mut dx = g.upload(&[1.0f32; 10]).unwrap();
        let dd = g.upload(&[1.0f32; 9]).unwrap();
        let dw = g.upload(&[1.0f32; 5]).unwrap();
        let mut out = g.zeros::<f32>(10).unwrap();
        assert!(matches!(
            g.add_rms_norm(&mut dx, &dd, &dw, &mut out, None, 1e-6),
            Err(CudaError::Shape(_))
        ));
    }

    #[test]
    fn act_mul_split_reads_gate_and_up_from_one_product() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(22);
        for (rows, width) in [(1usize, 1536usize), (6, 300)] {
            let gu = rand_vec(&mut r, rows * 2 * width, 4.0);
            for act in [
                Activation::Silu,
                Activation::GeluTanh,
                Activation::GeluErf,
                Activation::Relu,
            ] {
                let want: Vec<f64> = (0..rows * width)
                    .map(|i| {
                        let (row, c) = (i / width, i % width);
                        let a = gu[row * 2 * width + c] as f64;
                        let u = gu[row * 2 * width + width + c] as f64;
                        activation_ref(act, a) * u
                    })
                    .collect();
                let dgu = g.upload(&gu).unwrap();
                let mut out = g.zeros::<f32>(rows * width).unwrap();
                let mut half = g.zeros::<bf16>(rows * width).unwrap();
                g.act_mul_split(&dgu, &mut out, &mut half, width, act)
                    .unwrap();
                let got = g.download(&out).unwrap();
                let name = format!("act_mul_split {rows}x{width} {act:?}");
                assert_close(&got, &want, 1e-5, &name);
                assert_bf16_copy(&got, &g.download(&half).unwrap(), &name);
            }
        }
    }

    #[test]
    fn split_columns_copies_each_part_exactly() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(23);
        for (rows, widths) in [
            (1usize, vec![576usize, 192, 192]),
            (7, vec![64, 32]),
            (3, vec![5, 1, 7, 2]),
        ] {
            let total: usize = widths.iter().sum();
            let x = rand_vec(&mut r, rows * total, 1.0);
            let dx = g.upload(&x).unwrap();
            let mut outs: Vec<_> = widths
                .iter()
                .map(|&w| g.zeros::<f32>(rows * w).unwrap())
                .collect();
            let mut refs: Vec<_> = outs.iter_mut().collect();
            g.split_columns(&dx, rows, &mut refs).unwrap();
            let mut col0 = 0;
            for (o, &w) in outs.iter().zip(&widths) {
                let want: Vec<f32> = (0..rows)
                    .flat_map(|row| x[row * total + col0..row * total + col0 + w].to_vec())
                    .collect();
                assert_eq!(
                    g.download(o).unwrap(),
                    want,
                    "rows {rows} widths {widths:?}"
                );
                col0 += w;
            }
        }
        let dx = g.upload(&[0.0f32; 10]).unwrap();
        let mut a = g.zeros::<f32>(4).unwrap();
        let mut b = g.zeros::<f32>(4).unwrap();
        assert!(g.split_columns(&dx, 2, &mut [&mut a, &mut b]).is_err());
    }

    #[test]
    fn rope_qk_equals_rope_of_each() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(24);
        let (tokens, q_heads, k_heads, d) = (6usize, 9usize, 3usize, 64usize);
        for (half, adjacent) in [(32usize, false), (32, true), (16, false)] {
            let q = rand_vec(&mut r, tokens * q_heads * d, 2.0);
            let k = rand_vec(&mut r, tokens * k_heads * d, 2.0);
            let angles: Vec<f32> = (0..tokens * half)
                .map(|_| r.gen_range(0.0f32..6.3))
                .collect();
            let dc = g
                .upload(&angles.iter().map(|a| a.cos()).collect::<Vec<_>>())
                .unwrap();
            let ds = g
                .upload(&angles.iter().map(|a| a.sin()).collect::<Vec<_>>())
                .unwrap();
            let (mut q1, mut k1) = (g.upload(&q).unwrap(), g.upload(&k).unwrap());
            g.rope(&mut q1, &dc, &ds, q_heads, d, half, adjacent)
                .unwrap();
            g.rope(&mut k1, &dc, &ds, k_heads, d, half, adjacent)
                .unwrap();
            let (mut q2, mut k2) = (g.upload(&q).unwrap(), g.upload(&k).unwrap());
            g.rope_qk(
                (&mut q2, q_heads),
                (&mut k2, k_heads),
                &dc,
                &ds,
                d,
                half,
                adjacent,
            )
            .unwrap();
            let what = format!("half {half} adjacent {adjacent}");
            assert_eq!(
                g.download(&q2).unwrap(),
                g.download(&q1).unwrap(),
                "q, {what}"
            );
            assert_eq!(
                g.download(&k2).unwrap(),
                g.download(&k1).unwrap(),
                "k, {what}"
            );
            assert_ne!(g.download(&q2).unwrap(), q, "q turned, {what}");
        }
    }

    /// x · Wᵀ in f64 for x `[m, k]` and W `[n, k]` (bf16 values as f32).
    fn product_reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        (0..m)
            .flat_map(|r| {
                (0..n).map(move |j| {
                    (0..k)
                        .map(|c| x[r * k + c] as f64 * w[j * k + c] as f64)
                        .sum::<f64>()
                })
            })
            .collect()
    }

    fn bf16_matrix(r: &mut StdRng, n: usize) -> (Vec<bf16>, Vec<f32>) {
        let w: Vec<bf16> = rand_vec(r, n, 0.5)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let as_f32 = w.iter().map(|v| v.to_f32()).collect();
        (w, as_f32)
    }

    /// `x · Wᵀ` by the small product into one output per width, with `splits` warps a
    /// column, the columns of every part put back in place: `[m, n]`.
    fn gemv_in_parts(
        g: &Gpu,
        dx: &cudarc::driver::CudaSlice<f32>,
        weights: GemvWeights<'_>,
        (m, k): (usize, usize),
        widths: &[usize],
        splits: Option<usize>,
    ) -> Vec<f32> {
        let mut outs: Vec<_> = widths
            .iter()
            .map(|&wd| g.zeros::<f32>(m * wd).unwrap())
            .collect();
        let mut refs: Vec<_> = outs.iter_mut().collect();
        let extras = GemvExtras {
            splits,
            ..GemvExtras::default()
        };
        g.gemv(dx, weights, m, k, &mut refs, extras).unwrap();
        let parts: Vec<Vec<f32>> = outs.iter().map(|o| g.download(o).unwrap()).collect();
        (0..m)
            .flat_map(|row| {
                parts
                    .iter()
                    .zip(widths)
                    .flat_map(|(p, &wd)| p[row * wd..(row + 1) * wd].to_vec())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn gemv_matches_reference_and_splits_its_output() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(25);
        // Short rows (x staged rows apart by k), long ones (several tiles of x, the last
        // one short), every row count it takes.
        for (m, k, widths) in [
            (1usize, 576usize, vec![576usize, 192, 192]),
            (3, 64, vec![40]),
            (2, 2056, vec![24, 8]),
            (4, 8192, vec![33]),
            (4, 3080, vec![16, 8, 9]),
        ] {
            let n: usize = widths.iter().sum();
            let x = rand_vec(&mut r, m * k, 2.0);
            let (w, wf) = bf16_matrix(&mut r, n * k);
            let want = product_reference(&x, &wf, m, n, k);
            let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
            for splits in [None, Some(1), Some(2), Some(4)] {
                let weights = GemvWeights::Bf16(&dw);
                let got = gemv_in_parts(&g, &dx, weights, (m, k), &widths, splits);
                assert_close(
                    &got,
                    &want,
                    1e-5,
                    &format!("gemv m {m} k {k} widths {widths:?} splits {splits:?}"),
                );
            }
        }
        // Rows of a length the 16-byte loads cannot take, or too many rows: refused.
        let dx = g.upload(&[1.0f32; 12]).unwrap();
        let dw = g.upload(&[bf16::ONE; 24]).unwrap();
        let mut out = g.zeros::<f32>(2).unwrap();
        assert!(g
            .gemv(
                &dx,
                GemvWeights::Bf16(&dw),
                1,
                12,
                &mut [&mut out],
                GemvExtras::default()
            )
            .is_err());
        // Splits other than 1, 2 or 4 are refused.
        let dx = g.upload(&[1.0f32; 16]).unwrap();
        let dw = g.upload(&[bf16::ONE; 32]).unwrap();
        for splits in [0, 3, 8] {
            let extras = GemvExtras {
                splits: Some(splits),
                ..GemvExtras::default()
            };
            assert!(matches!(
                g.gemv(&dx, GemvWeights::Bf16(&dw), 1, 16, &mut [&mut out], extras),
                Err(CudaError::Shape(_))
            ));
        }
        assert!(!lantern_cuda::gemv::gemv_fits(5, 64));
    }

    #[test]
    fn gemv_gated_matches_reference() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(26);
        for (m, k, width) in [
            (1usize, 576usize, 1536usize),
            (4, 2048, 100),
            (3, 160, 64),
            (4, 7000, 24),
        ] {
            let x = rand_vec(&mut r, m * k, 2.0);
            let (w, wf) = bf16_matrix(&mut r, 2 * width * k);
            let both = product_reference(&x, &wf, m, 2 * width, k);
            for act in [
                Activation::Silu,
                Activation::GeluTanh,
                Activation::GeluErf,
                Activation::Relu,
            ] {
                let want: Vec<f64> = (0..m * width)
                    .map(|i| {
                        let (row, j) = (i / width, i % width);
                        let (gate, up) =
                            (both[row * 2 * width + j], both[row * 2 * width + width + j]);
                        activation_ref(act, gate) * up
                    })
                    .collect();
                let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
                for splits in [1, 2, 4] {
                    let mut out = g.zeros::<f32>(m * width).unwrap();
                    let extras = GemvExtras {
                        splits: Some(splits),
                        ..GemvExtras::default()
                    };
                    g.gemv_gated(&dx, GemvWeights::Bf16(&dw), m, k, &mut out, act, extras)
                        .unwrap();
                    assert_close(
                        &g.download(&out).unwrap(),
                        &want,
                        1e-5,
                        &format!("gemv_gated m {m} k {k} width {width} {act:?} splits {splits}"),
                    );
                }
            }
        }
    }

    /// The small products' norm (x normalized as it is staged, one tile or several) against
    /// the product of the normed rows, and their residual add (the output added to, not
    /// written) against the plain product added on the host: the same bits.
    #[test]
    fn gemv_folds_the_norm_and_the_residual_add() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(27);
        let eps = 1e-5f32;
        for (m, k, n) in [
            (1usize, 576usize, 960usize),
            (4, 576, 64),
            (2, 8192, 40),
            (4, 12288, 24),
        ] {
            let what = format!("m {m} k {k} n {n}");
            let x = rand_vec(&mut r, m * k, 2.0);
            let weight = rand_vec(&mut r, k, 1.5);
            let (w, wf) = bf16_matrix(&mut r, n * k);
            let normed: Vec<f32> = rms_reference(&x, &weight, eps)
                .into_iter()
                .map(|v| v as f32)
                .collect();
            let (dx, dw, dn) = (
                g.upload(&x).unwrap(),
                g.upload(&w).unwrap(),
                g.upload(&weight).unwrap(),
            );
            let mut out = g.zeros::<f32>(m * n).unwrap();
            let norm = GemvExtras {
                norm: Some((&dn, eps)),
                ..GemvExtras::default()
            };
            g.gemv(&dx, GemvWeights::Bf16(&dw), m, k, &mut [&mut out], norm)
                .unwrap();
            assert_close(
                &g.download(&out).unwrap(),
                &product_reference(&normed, &wf, m, n, k),
                1e-5,
                &format!("normed gemv {what}"),
            );

            let acc = rand_vec(&mut r, m * n, 3.0);
            let mut plain = g.zeros::<f32>(m * n).unwrap();
            g.gemv(
                &dx,
                GemvWeights::Bf16(&dw),
                m,
                k,
                &mut [&mut plain],
                GemvExtras::default(),
            )
            .unwrap();
            let want: Vec<f32> = acc
                .iter()
                .zip(g.download(&plain).unwrap())
                .map(|(a, y)| a + y)
                .collect();
            let mut residual = g.upload(&acc).unwrap();
            let add = GemvExtras {
                accumulate: true,
                ..GemvExtras::default()
            };
            g.gemv(&dx, GemvWeights::Bf16(&dw), m, k, &mut [&mut residual], add)
                .unwrap();
            assert_eq!(g.download(&residual).unwrap(), want, "accumulated {what}");

            let width = n / 2;
            let (wg, wgf) = bf16_matrix(&mut r, 2 * width * k);
            let dwg = g.upload(&wg).unwrap();
            let mut gated = g.zeros::<f32>(m * width).unwrap();
            g.gemv_gated(
                &dx,
                GemvWeights::Bf16(&dwg),
                m,
                k,
                &mut gated,
                Activation::Silu,
                GemvExtras {
                    norm: Some((&dn, eps)),
                    splits: Some(4),
                    ..GemvExtras::default()
                },
            )
            .unwrap();
            let both = product_reference(&normed, &wgf, m, 2 * width, k);
            let want: Vec<f64> = (0..m * width)
                .map(|i| {
                    let (row, j) = (i / width, i % width);
                    let (gate, up) = (both[row * 2 * width + j], both[row * 2 * width + width + j]);
                    gate / (1.0 + (-gate).exp()) * up
                })
                .collect();
            assert_close(
                &g.download(&gated).unwrap(),
                &want,
                1e-5,
                &format!("normed gated gemv {what}"),
            );
        }
        // A norm weight of another length than the rows is refused.
        let (dx, dw) = (
            g.upload(&[1.0f32; 16]).unwrap(),
            g.upload(&[bf16::ONE; 32]).unwrap(),
        );
        let short = g.upload(&[1.0f32; 8]).unwrap();
        let mut out = g.zeros::<f32>(2).unwrap();
        let bad = GemvExtras {
            norm: Some((&short, 1e-5)),
            ..GemvExtras::default()
        };
        assert!(matches!(
            g.gemv(&dx, GemvWeights::Bf16(&dw), 1, 16, &mut [&mut out], bad),
            Err(CudaError::Shape(_))
        ));
    }

    /// A random `[n, k]` matrix quantized to `ty` by candle (valid GGUF blocks), in the
    /// blockwise form, with its values.
    fn blockwise_matrix(
        r: &mut StdRng,
        ty: QuantType,
        n: usize,
        k: usize,
    ) -> (Blockwise, Vec<f32>) {
        let values = rand_vec(r, n * k, 0.5);
        let t = candle_core::Tensor::from_vec(values, (n, k), &candle_core::Device::Cpu).unwrap();
        let dtype = match ty {
            QuantType::Q4_0 => GgmlDType::Q4_0,
            QuantType::Q4_1 => GgmlDType::Q4_1,
            QuantType::Q5_0 => GgmlDType::Q5_0,
            QuantType::Q5_1 => GgmlDType::Q5_1,
            QuantType::Q8_0 => GgmlDType::Q8_0,
            QuantType::Q4K => GgmlDType::Q4K,
            QuantType::Q5K => GgmlDType::Q5K,
            QuantType::Q6K => GgmlDType::Q6K,
            QuantType::Q3K => GgmlDType::Q3K,
            other => panic!("{other} is not quantized"),
        };
        let q = QTensor::quantize(&t, dtype).unwrap();
        let form = Blockwise::from_gguf_bytes(ty, &q.data().unwrap(), n, k).unwrap();
        let w = (0..n * k).map(|i| form.value(i)).collect();
        (form, w)
    }

    /// GGUF weights kept quantized: dequantized rows (bf16 for cuBLAS) and embeddings
    /// have the bits the CPU's dequantization gives, for every quantized type.
    #[test]
    fn blocks_dequantize_and_embed_as_the_cpu_does() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(28);
        for ty in QuantType::QUANTIZED {
            let (n, k) = (5, 2 * ty.block_values());
            let (form, w) = blockwise_matrix(&mut r, ty, n, k);
            let dw = g.upload_blocks(&form).unwrap();
            assert_eq!((dw.rows(), dw.cols(), dw.quant_type()), (n, k, ty));
            let mut rows = g.zeros::<bf16>(3 * k).unwrap();
            g.dequantize_blocks_bf16(&dw, 1..4, &mut rows).unwrap();
            let want: Vec<bf16> = w[k..4 * k].iter().map(|&v| bf16::from_f32(v)).collect();
            assert_eq!(g.download(&rows).unwrap(), want, "{ty} rows 1..4");

            let ids = g.upload(&[4u32, 0, 4, 2]).unwrap();
            let mut out = g.zeros::<f32>(4 * k).unwrap();
            g.embed_blocks(&dw, &ids, &mut out, 0.5).unwrap();
            let want: Vec<f32> = [4, 0, 4, 2]
                .iter()
                .flat_map(|&id| w[id * k..(id + 1) * k].iter().map(|v| v * 0.5))
                .collect();
            assert_eq!(g.download(&out).unwrap(), want, "{ty} embeddings");

            let mut short = g.zeros::<bf16>(k).unwrap();
            assert!(g.dequantize_blocks_bf16(&dw, 4..6, &mut short).is_err());
            assert!(g.dequantize_blocks_bf16(&dw, 0..2, &mut short).is_err());
        }
    }

    /// The small products over GGUF weights as stored: plain, split into parts, gated,
    /// with the norm folded in and accumulating, against the products of the CPU's
    /// dequantized values.
    #[test]
    fn gemv_over_blocks_matches_the_dequantized_product() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(29);
        let eps = 1e-5f32;
        for (ty, m, k, widths) in [
            (QuantType::Q4_1, 1usize, 576usize, vec![576usize, 192, 192]),
            (QuantType::Q8_0, 4, 576, vec![64]),
            (QuantType::Q4_0, 3, 2048, vec![24, 8]),
            (QuantType::Q6K, 2, 12800, vec![40]),
            (QuantType::Q4K, 4, 1024, vec![16, 16, 9]),
            (QuantType::Q5K, 1, 256, vec![33]),
            (QuantType::Q5_0, 2, 96, vec![8]),
            (QuantType::Q5_1, 4, 160, vec![20]),
        ] {
            let what = format!("{ty} m {m} k {k} widths {widths:?}");
            let n: usize = widths.iter().sum();
            let x = rand_vec(&mut r, m * k, 2.0);
            let (form, wf) = blockwise_matrix(&mut r, ty, n, k);
            let dw = g.upload_blocks(&form).unwrap();
            let dx = g.upload(&x).unwrap();
            let want = product_reference(&x, &wf, m, n, k);
            for splits in [None, Some(2), Some(4)] {
                let weights = GemvWeights::Blocks(&dw);
                let got = gemv_in_parts(&g, &dx, weights, (m, k), &widths, splits);
                assert_close(&got, &want, 1e-5, &format!("{what} splits {splits:?}"));
            }

            // The norm folded in, and the output added to.
            let weight = rand_vec(&mut r, k, 1.5);
            let normed: Vec<f32> = rms_reference(&x, &weight, eps)
                .into_iter()
                .map(|v| v as f32)
                .collect();
            let dn = g.upload(&weight).unwrap();
            let acc = rand_vec(&mut r, m * n, 3.0);
            let mut residual = g.upload(&acc).unwrap();
            let extras = GemvExtras {
                norm: Some((&dn, eps)),
                accumulate: true,
                ..GemvExtras::default()
            };
            g.gemv(
                &dx,
                GemvWeights::Blocks(&dw),
                m,
                k,
                &mut [&mut residual],
                extras,
            )
            .unwrap();
            let want: Vec<f64> = product_reference(&normed, &wf, m, n, k)
                .iter()
                .zip(&acc)
                .map(|(y, &a)| y + a as f64)
                .collect();
            assert_close(
                &g.download(&residual).unwrap(),
                &want,
                1e-5,
                &format!("normed, accumulated {what}"),
            );
        }

        // Gated: gate rows, then up rows, of one quantized matrix.
        let (m, k, width) = (3, 512, 48);
        let x = rand_vec(&mut r, m * k, 2.0);
        let (form, wf) = blockwise_matrix(&mut r, QuantType::Q4K, 2 * width, k);
        let (dx, dw) = (g.upload(&x).unwrap(), g.upload_blocks(&form).unwrap());
        let both = product_reference(&x, &wf, m, 2 * width, k);
        let want: Vec<f64> = (0..m * width)
            .map(|i| {
                let (row, j) = (i / width, i % width);
                let (gate, up) = (both[row * 2 * width + j], both[row * 2 * width + width + j]);
                gate / (1.0 + (-gate).exp()) * up
            })
            .collect();
        let mut out = g.zeros::<f32>(m * width).unwrap();
        g.gemv_gated(
            &dx,
            GemvWeights::Blocks(&dw),
            m,
            k,
            &mut out,
            Activation::Silu,
            GemvExtras::default(),
        )
        .unwrap();
        assert_close(&g.download(&out).unwrap(), &want, 1e-5, "gated Q4_K");

        // Rows of another width than the blocks' are refused.
        let mut out = g.zeros::<f32>(2 * 2 * width).unwrap();
        let dx = g.upload(&vec![1.0f32; k / 2]).unwrap();
        assert!(matches!(
            g.gemv(
                &dx,
                GemvWeights::Blocks(&dw),
                1,
                k / 2,
                &mut [&mut out],
                GemvExtras::default()
            ),
            Err(CudaError::Shape(_))
        ));
    }

    /// A product over some rows of a matrix written into its columns of the whole
    /// product's output (how GGUF matrices are multiplied a dequantized chunk at a time),
    /// the other columns left as they were.
    #[test]
    fn gemm_columns_write_a_product_where_its_rows_go() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(30);
        let (m, n, k) = (6usize, 40usize, 96usize);
        let (x, xf) = bf16_matrix(&mut r, m * k);
        let (w, wf) = bf16_matrix(&mut r, n * k);
        let want = product_reference(&xf, &wf, m, n, k);
        let dx = g.upload(&x).unwrap();
        let mut y = g.upload(&vec![7.0f32; m * n]).unwrap();
        for (col0, cols) in [(0usize, 16usize), (16, 20)] {
            let dw = g.upload(&w[col0 * k..(col0 + cols) * k]).unwrap();
            g.gemm_bf16_columns(&dx, &dw, &mut y, m, (col0, cols, n), k)
                .unwrap();
        }
        let got = g.download(&y).unwrap();
        for row in 0..m {
            assert_close(
                &got[row * n..row * n + 36],
                &want[row * n..row * n + 36],
                1e-5,
                &format!("row {row}"),
            );
            assert!(got[row * n + 36..(row + 1) * n].iter().all(|&v| v == 7.0));
        }
        // Columns past the output's width are refused.
        let dw = g.upload(&w[..8 * k]).unwrap();
        assert!(g
            .gemm_bf16_columns(&dx, &dw, &mut y, m, (36, 8, n), k)
            .is_err());
    }

    /// The variants capture's kernels are checked on: plain, window, chunk, soft-cap with
    /// sinks.
    fn capture_variants() -> [Variant; 4] {
        [
            BASE,
            Variant {
                window: Some(40),
                ..BASE
            },
            Variant {
                chunk: Some(64),
                ..BASE
            },
            Variant {
                cap: Some(30.0),
                sinks: true,
                ..BASE
            },
        ]
    }

    /// The layer description capture's kernels take for `variant`, its sinks `sinks`.
    fn capture_params<'a>(
        (heads, kv_heads, head_dim): (usize, usize, usize),
        scale: f32,
        variant: Variant,
        sinks: &'a cudarc::driver::CudaSlice<f32>,
    ) -> AttnParams<'a> {
        AttnParams {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            scale,
            sliding_window: variant.window,
            chunk_size: variant.chunk,
            soft_cap: variant.cap,
            sinks: variant.sinks.then(|| sinks.as_view()),
        }
    }

    /// One query head's f64 probabilities over a request's keys in a host copy of the
    /// cache, block table `table` (16 keys a block).
    struct Reference<'a, T> {
        cache: &'a [T],
        strides: &'a KvStrides,
        table: &'a [u32],
        kv_head: usize,
        scale: f32,
        variant: Variant,
        sink: f32,
    }

    impl<T: CacheElem> Reference<'_, T> {
        fn probabilities(&self, q: &[f32], keys: std::ops::Range<usize>) -> Vec<f64> {
            let bs = 16;
            let logits: Vec<f64> = keys
                .map(|k| {
                    let slot = self.table[k / bs] as usize * bs + k % bs;
                    let dot: f64 = (0..q.len())
                        .map(|j| {
                            let key = self.cache[self.strides.key_offset(slot, self.kv_head, j)];
                            q[j] as f64 * key.to_f32() as f64
                        })
                        .sum();
                    let l = dot * self.scale as f64;
                    let cap = self.variant.cap;
                    cap.map_or(l, |c| c as f64 * (l / c as f64).tanh())
                })
                .collect();
            let sink = self.variant.sinks.then_some(self.sink as f64);
            let mx = logits
                .iter()
                .fold(sink.unwrap_or(f64::NEG_INFINITY), |m, &l| m.max(l));
            let denom: f64 = logits.iter().map(|l| (l - mx).exp()).sum::<f64>()
                + sink.map_or(0.0, |s| (s - mx).exp());
            logits.iter().map(|l| (l - mx).exp() / denom).collect()
        }
    }

    /// Capture's row probabilities (`capture.cu`) against f64 from the same cache: rows of
    /// several requests with windows, a chunk, soft-cap and sinks, both layouts, every
    /// cache type; a row whose keys meet an unassigned block comes back NaN.
    fn row_probabilities_case<T: CacheElem>(g: &Gpu, r: &mut StdRng, variant: Variant) {
        use lantern_cuda::capture::ProbabilityRow;
        let (heads, kvh, d, bs) = (9, 3, 64, 16);
        let seqs: Vec<usize> = (0..4).map(|_| r.gen_range(1..=300)).collect();
        let stride = seqs.iter().map(|s| s.div_ceil(bs)).max().unwrap() + 1;
        let mut free: Vec<u32> = (0..NUM_BLOCKS as u32).collect();
        let mut table = vec![u32::MAX; seqs.len() * stride];
        for (ri, &s) in seqs.iter().enumerate() {
            for b in 0..s.div_ceil(bs) {
                table[ri * stride + b] = free.swap_remove(r.gen_range(0..free.len()));
            }
        }
        // Rows: each request's last position and a random earlier one; batch tokens 0..8.
        let visible = |p: usize| {
            let mut lo = 0;
            if let Some(w) = variant.window {
                lo = (p + 1).saturating_sub(w);
            }
            if let Some(c) = variant.chunk {
                lo = lo.max(p / c * c);
            }
            lo..p + 1
        };
        let mut rows = Vec::new();
        let mut offset = 0;
        for (ri, &s) in seqs.iter().enumerate() {
            for p in [s - 1, r.gen_range(0..s)] {
                let keys = visible(p);
                let n = keys.len();
                rows.push(ProbabilityRow {
                    token: rows.len(),
                    request: ri,
                    keys,
                    offset,
                });
                offset += n * heads;
            }
        }
        let t = rows.len();
        for (name, s) in layouts(NUM_BLOCKS, bs, kvh, d) {
            let cache: Vec<T> = (0..s.cache_len(NUM_BLOCKS))
                .map(|_| T::from_f32(r.gen_range(-1.0f32..1.0)))
                .collect();
            let q = rand_vec(r, t * heads * d, 1.0);
            let sinks: Vec<f32> = (0..heads).map(|_| r.gen_range(-1.0f32..3.0)).collect();
            let scale = if variant.cap.is_some() { 1.5 } else { 0.125 };
            let mut want = vec![0.0f64; offset];
            for row in &rows {
                let n = row.keys.len();
                for h in 0..heads {
                    let qv = &q[(row.token * heads + h) * d..][..d];
                    let table = &table[row.request * stride..][..stride];
                    let probs = Reference {
                        cache: &cache,
                        strides: &s,
                        table,
                        kv_head: h / (heads / kvh),
                        scale,
                        variant,
                        sink: sinks[h],
                    }
                    .probabilities(qv, row.keys.clone());
                    want[row.offset + h * n..][..n].copy_from_slice(&probs);
                }
            }
            let (dq, dcache, dtable) = (
                g.upload(&q).unwrap(),
                g.upload(&cache).unwrap(),
                g.upload(&table).unwrap(),
            );
            let dsinks = g.upload(&sinks).unwrap();
            let spec = capture_params((heads, kvh, d), scale, variant, &dsinks);
            let mut dout = g.upload(&vec![f32::NAN; offset]).unwrap();
            g.row_probabilities(&dq, &dcache, &s, (&dtable, stride), &rows, &spec, &mut dout)
                .unwrap();
            let got = g.download(&dout).unwrap();
            let what = format!("row_probabilities {} {name} {variant:?}", T::SUFFIX);
            assert_close(&got, &want, 1e-4, &what);
            // Each row of each head sums to 1 (less the sink's share).
            for row in &rows {
                let n = row.keys.len();
                for h in 0..heads {
                    let sum: f32 = got[row.offset + h * n..][..n].iter().sum();
                    assert!(
                        variant.sinks || (sum - 1.0).abs() < 1e-4,
                        "{what}: sums to {sum}"
                    );
                }
            }
            // A row reaching an unassigned block: NaN, never another request's keys.
            let mut broken = table.clone();
            let first = &rows[0];
            broken[first.request * stride + (first.keys.end - 1) / bs] = u32::MAX;
            let dbroken = g.upload(&broken).unwrap();
            g.row_probabilities(
                &dq,
                &dcache,
                &s,
                (&dbroken, stride),
                &rows[..1],
                &spec,
                &mut dout,
            )
            .unwrap();
            let got = g.download(&dout).unwrap();
            let n = first.keys.len() * heads;
            assert!(
                got[..n].iter().all(|v| v.is_nan()),
                "{what}: a broken row is not NaN"
            );
        }
    }

    #[test]
    fn row_probabilities_match_reference() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(21);
        for variant in capture_variants() {
            row_probabilities_case::<f32>(&g, &mut r, variant);
            row_probabilities_case::<f16>(&g, &mut r, variant);
            row_probabilities_case::<bf16>(&g, &mut r, variant);
        }
    }

    /// A finished capture's map kernels (`capture.cu`) on one request's rows: the
    /// probabilities against f64 from the same cache (masked keys exactly 0, a few heads
    /// out of order), then heads combined and top-k kept bit for bit as lantern-attn's
    /// host definitions give them from the device's own probabilities; a row meeting an
    /// unassigned block sets the flag.
    fn map_case<T: CacheElem>(g: &Gpu, r: &mut StdRng, variant: Variant) {
        use lantern_attn::{combine_heads, top_k, HeadCombine};
        let (heads, kvh, d, bs) = (9, 3, 64, 16);
        let seq: usize = r.gen_range(20..=300);
        let table: Vec<u32> = {
            let mut free: Vec<u32> = (0..NUM_BLOCKS as u32).collect();
            (0..seq.div_ceil(bs))
                .map(|_| free.swap_remove(r.gen_range(0..free.len())))
                .collect()
        };
        let visible = |p: usize| {
            let mut lo = 0;
            if let Some(w) = variant.window {
                lo = (p + 1).saturating_sub(w);
            }
            if let Some(c) = variant.chunk {
                lo = lo.max(p / c * c);
            }
            lo..p + 1
        };
        let first = r.gen_range(0..seq - 10);
        let positions = first..r.gen_range(first + 1..=seq);
        let num_keys = positions.end;
        let keys: Vec<_> = positions.clone().map(visible).collect();
        let asked = [7usize, 0, 4, 5];
        let rows = positions.len();
        for (name, s) in layouts(NUM_BLOCKS, bs, kvh, d) {
            let cache: Vec<T> = (0..s.cache_len(NUM_BLOCKS))
                .map(|_| T::from_f32(r.gen_range(-1.0f32..1.0)))
                .collect();
            let q = rand_vec(r, rows * asked.len() * d, 1.0);
            let sinks: Vec<f32> = (0..heads).map(|_| r.gen_range(-1.0f32..3.0)).collect();
            let scale = if variant.cap.is_some() { 1.5 } else { 0.125 };
            let mut want = vec![0.0f64; rows * asked.len() * num_keys];
            for (i, vis) in keys.iter().enumerate() {
                for (hi, &h) in asked.iter().enumerate() {
                    let qv = &q[(i * asked.len() + hi) * d..][..d];
                    let probs = Reference {
                        cache: &cache,
                        strides: &s,
                        table: &table,
                        kv_head: h / (heads / kvh),
                        scale,
                        variant,
                        sink: sinks[h],
                    }
                    .probabilities(qv, vis.clone());
                    let row = &mut want[(i * asked.len() + hi) * num_keys..];
                    row[vis.clone()].copy_from_slice(&probs);
                }
            }
            let (dq, dcache, dtable) = (
                g.upload(&q).unwrap(),
                g.upload(&cache).unwrap(),
                g.upload(&table).unwrap(),
            );
            let dsinks = g.upload(&sinks).unwrap();
            let spec = capture_params((heads, kvh, d), scale, variant, &dsinks);
            let what = format!("map_probabilities {} {name} {variant:?}", T::SUFFIX);
            let mut dense = g.zeros::<f32>(want.len()).unwrap();
            let mut bad = g.zeros::<u32>(1).unwrap();
            let shape = (&asked[..], &keys[..], num_keys);
            g.map_probabilities(
                &dq, &dcache, &s, &dtable, shape, &spec, &mut dense, &mut bad,
            )
            .unwrap();
            assert_eq!(g.download(&bad).unwrap(), [0], "{what}: flagged bad");
            let got = g.download(&dense).unwrap();
            assert_close(&got, &want, 1e-4, &what);
            for (i, vis) in keys.iter().enumerate() {
                for hi in 0..asked.len() {
                    let row = &got[(i * asked.len() + hi) * num_keys..][..num_keys];
                    let outside = (0..num_keys).filter(|j| !vis.contains(j));
                    assert!(
                        outside.into_iter().all(|j| row[j] == 0.0),
                        "{what}: masked keys"
                    );
                }
            }
            // Heads combined, then top-k, against the host definitions on these values.
            for combine in [HeadCombine::Each, HeadCombine::Mean, HeadCombine::Max] {
                let (combined, out_heads) = if combine == HeadCombine::Each {
                    (g.upload(&got).unwrap(), asked.len())
                } else {
                    let mut out = g.zeros::<f32>(rows * num_keys).unwrap();
                    g.combine_heads(&dense, (asked.len(), num_keys), combine, &mut out)
                        .unwrap();
                    (out, 1)
                };
                let mut host = Vec::new();
                combine_heads(&got, asked.len(), num_keys, combine, &mut host);
                let on_device = g.download(&combined).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&on_device), bits(&host), "{what}: {combine:?}");
                for k in [1, 7, num_keys] {
                    let n = rows * out_heads * k;
                    let (mut vals, mut idx) =
                        (g.zeros::<f32>(n).unwrap(), g.zeros::<u32>(n).unwrap());
                    g.top_k_rows(&combined, (num_keys, k), &mut vals, &mut idx)
                        .unwrap();
                    let (mut hv, mut hx) = (Vec::new(), Vec::new());
                    top_k(&host, num_keys, k, &mut hv, &mut hx);
                    assert_eq!(
                        bits(&g.download(&vals).unwrap()),
                        bits(&hv),
                        "{what}: top {k}"
                    );
                    assert_eq!(g.download(&idx).unwrap(), hx, "{what}: top {k} positions");
                }
            }
            // A row reaching an unassigned block is flagged.
            let mut broken = table.clone();
            broken[(positions.end - 1) / bs] = u32::MAX;
            let dbroken = g.upload(&broken).unwrap();
            g.map_probabilities(
                &dq, &dcache, &s, &dbroken, shape, &spec, &mut dense, &mut bad,
            )
            .unwrap();
            assert_ne!(
                g.download(&bad).unwrap(),
                [0],
                "{what}: a broken row is not flagged"
            );
        }
    }

    #[test]
    fn capture_map_kernels_match_reference_and_the_host() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(22);
        for variant in capture_variants() {
            map_case::<f32>(&g, &mut r, variant);
            map_case::<f16>(&g, &mut r, variant);
            map_case::<bf16>(&g, &mut r, variant);
        }
    }

    /// Top-k among many equal values (ties by position) and every key kept.
    #[test]
    fn top_k_rows_break_ties_by_position() {
        let Some((g, _t)) = gpu() else { return };
        let mut r = rng(23);
        let (rows, keys) = (5, 700);
        let values: Vec<f32> = (0..rows * keys)
            .map(|_| [0.0, 0.25, 0.5, 1.0][r.gen_range(0..4)])
            .collect();
        let dv = g.upload(&values).unwrap();
        for k in [1, 3, 300, keys] {
            let (mut vals, mut idx) = (
                g.zeros::<f32>(rows * k).unwrap(),
                g.zeros::<u32>(rows * k).unwrap(),
            );
            g.top_k_rows(&dv, (keys, k), &mut vals, &mut idx).unwrap();
            let (mut hv, mut hx) = (Vec::new(), Vec::new());
            lantern_attn::top_k(&values, keys, k, &mut hv, &mut hx);
            assert_eq!(g.download(&vals).unwrap(), hv, "top {k}");
            assert_eq!(g.download(&idx).unwrap(), hx, "top {k} positions");
        }
        let mut none = g.zeros::<f32>(0).unwrap();
        let mut none_idx = g.zeros::<u32>(0).unwrap();
        assert!(g
            .top_k_rows(&dv, (keys, keys + 1), &mut none, &mut none_idx)
            .is_err());
    }
}
