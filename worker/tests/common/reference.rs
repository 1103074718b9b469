//! A deliberately naive f64 implementation of the Llama-family forward pass, written
//! straight from the architecture's definition (dense causal attention over the whole
//! sequence, no cache, no batching). The engine is checked against it.

pub struct RefLayer {
    pub attn_norm: Vec<f32>,
    /// `[rows][cols]` matrices.
    pub wq: Vec<Vec<f32>>,
    pub wk: Vec<Vec<f32>>,
    pub wv: Vec<Vec<f32>>,
    pub wo: Vec<Vec<f32>>,
    pub bias: Option<[Vec<f32>; 3]>,
    pub qk_norm: Option<[Vec<f32>; 2]>,
    pub ffn_norm: Vec<f32>,
    pub gate: Vec<Vec<f32>>,
    pub up: Vec<Vec<f32>>,
    pub down: Vec<Vec<f32>>,
}

pub struct RefModel {
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub eps: f64,
    pub theta: f64,
    /// true: pairs (2i, 2i+1); false: pairs (i, i + d/2).
    pub interleaved: bool,
    pub embed: Vec<Vec<f32>>,
    pub layers: Vec<RefLayer>,
    pub norm: Vec<f32>,
    pub lm_head: Vec<Vec<f32>>,
}

fn rms(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, &g)| v * s * g as f64).collect()
}

fn mv(w: &[Vec<f32>], x: &[f64]) -> Vec<f64> {
    w.iter().map(|row| row.iter().zip(x).map(|(&a, b)| a as f64 * b).sum()).collect()
}

fn rope(v: &mut [f64], pos: usize, d: usize, theta: f64, interleaved: bool) {
    for i in 0..d / 2 {
        let freq = theta.powf(-2.0 * i as f64 / d as f64);
        let (s, c) = (pos as f64 * freq).sin_cos();
        let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + d / 2) };
        let (x0, x1) = (v[a], v[b]);
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
    }
}

impl RefModel {
    /// Logits after every token of `tokens`, `[n][vocab]`.
    pub fn forward(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let (hd, nh, nkv) = (self.head_dim, self.n_heads, self.n_kv_heads);
        let mut xs: Vec<Vec<f64>> =
            tokens.iter().map(|&t| self.embed[t as usize].iter().map(|&v| v as f64).collect()).collect();
        for l in &self.layers {
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for (p, x) in xs.iter().enumerate() {
                let h = rms(x, &l.attn_norm, self.eps);
                let (mut q, mut k, mut v) = (mv(&l.wq, &h), mv(&l.wk, &h), mv(&l.wv, &h));
                if let Some([bq, bk, bv]) = &l.bias {
                    q.iter_mut().zip(bq).for_each(|(a, &b)| *a += b as f64);
                    k.iter_mut().zip(bk).for_each(|(a, &b)| *a += b as f64);
                    v.iter_mut().zip(bv).for_each(|(a, &b)| *a += b as f64);
                }
                for hh in 0..nh {
                    let s = &mut q[hh * hd..(hh + 1) * hd];
                    if let Some([nq, _]) = &l.qk_norm {
                        let n = rms(s, nq, self.eps);
                        s.copy_from_slice(&n);
                    }
                    rope(s, p, hd, self.theta, self.interleaved);
                }
                for hh in 0..nkv {
                    let s = &mut k[hh * hd..(hh + 1) * hd];
                    if let Some([_, nk]) = &l.qk_norm {
                        let n = rms(s, nk, self.eps);
                        s.copy_from_slice(&n);
                    }
                    rope(s, p, hd, self.theta, self.interleaved);
                }
                qs.push(q);
                ks.push(k);
                vs.push(v);
            }
            for p in 0..xs.len() {
                let mut att = vec![0.0f64; nh * hd];
                for hh in 0..nh {
                    let kvh = hh / (nh / nkv);
                    let q = &qs[p][hh * hd..(hh + 1) * hd];
                    let scores: Vec<f64> = (0..=p)
                        .map(|j| {
                            let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (j, w) in e.iter().enumerate() {
                        let v = &vs[j][kvh * hd..(kvh + 1) * hd];
                        for d in 0..hd {
                            att[hh * hd + d] += w / z * v[d];
                        }
                    }
                }
                let o = mv(&l.wo, &att);
                xs[p].iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                let h = rms(&xs[p], &l.ffn_norm, self.eps);
                let g = mv(&l.gate, &h);
                let u = mv(&l.up, &h);
                let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                let d = mv(&l.down, &a);
                xs[p].iter_mut().zip(&d).for_each(|(a, b)| *a += b);
            }
        }
        xs.iter().map(|x| mv(&self.lm_head, &rms(x, &self.norm, self.eps))).collect()
    }
}
