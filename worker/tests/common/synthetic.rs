//! Tiny random-weight models written as GGUF files in memory, for fast tests that need
//! no download. Weights are random normal-ish values (never zeros); the same weights are
//! returned as a [`RefModel`] for the naive reference.

use std::sync::Arc;

use half::f16;
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::GgmlType;
use tessera_model::gguf::{GgufFile, GgufWriter, MetaValue};
use tessera_model::weights::ModelFiles;

use super::reference::{RefLayer, RefModel};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
}

pub struct Shape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub layers: usize,
}

pub const TINY: Shape = Shape { hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, ffn: 96, vocab: 61, layers: 2 };

struct Gen(ChaCha8Rng);

impl Gen {
    fn val(&mut self, scale: f32) -> f32 {
        // Sum of uniforms: roughly normal, never exactly zero in practice.
        let s: f32 = (0..4).map(|_| (self.0.next_u32() as f32 / u32::MAX as f32) - 0.5).sum();
        s * scale
    }
    fn mat(&mut self, rows: usize, cols: usize) -> Vec<Vec<f32>> {
        let scale = 1.5 / (cols as f32).sqrt();
        (0..rows).map(|_| (0..cols).map(|_| self.val(scale)).collect()).collect()
    }
    fn norm(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| 1.0 + self.val(0.3)).collect()
    }
}

/// Q8_0 bytes of one row (whole blocks of 32), and the values they decode to.
fn q8_0_row(row: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut deq = Vec::new();
    for b in row.chunks(32) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = f16::from_f32(amax / 127.0);
        let df = d.to_f32();
        bytes.extend_from_slice(&d.to_le_bytes());
        for &v in b {
            let q = if df > 0.0 { (v / df).round().clamp(-127.0, 127.0) as i8 } else { 0 };
            bytes.push(q as u8);
            deq.push(q as f32 * df);
        }
    }
    (bytes, deq)
}

/// Writes a model of `shape`; 2-D weights stored as `ty` (F32 or Q8_0). Returns the files
/// and the reference model holding exactly the values the file decodes to.
pub fn build(family: Family, shape: &Shape, ty: GgmlType, seed: u64) -> (Arc<ModelFiles>, RefModel) {
    build_with_v_type(family, shape, ty, ty, seed)
}

/// As [`build`], with `attn_v` stored as `v_ty` (quantised files mix types, e.g. Q4_K_M
/// keeps v in Q6_K), which stops the engine from fusing q/k/v.
pub fn build_with_v_type(
    family: Family,
    shape: &Shape,
    ty: GgmlType,
    v_ty: GgmlType,
    seed: u64,
) -> (Arc<ModelFiles>, RefModel) {
    let mut g = Gen(ChaCha8Rng::seed_from_u64(seed));
    let arch = match family {
        Family::Llama => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
    };
    let mut w = GgufWriter::new();
    w.add_meta("general.architecture", MetaValue::String(arch.into()));
    let key = |k: &str| format!("{arch}.{k}");
    w.add_meta(key("block_count"), MetaValue::U32(shape.layers as u32));
    w.add_meta(key("embedding_length"), MetaValue::U32(shape.hidden as u32));
    w.add_meta(key("feed_forward_length"), MetaValue::U32(shape.ffn as u32));
    w.add_meta(key("attention.head_count"), MetaValue::U32(shape.heads as u32));
    w.add_meta(key("attention.head_count_kv"), MetaValue::U32(shape.kv_heads as u32));
    w.add_meta(key("attention.key_length"), MetaValue::U32(shape.head_dim as u32));
    w.add_meta(key("attention.value_length"), MetaValue::U32(shape.head_dim as u32));
    w.add_meta(key("context_length"), MetaValue::U32(4096));
    w.add_meta(key("attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-5));
    w.add_meta(key("rope.freq_base"), MetaValue::F32(10000.0));
    w.add_meta(key("vocab_size"), MetaValue::U32(shape.vocab as u32));

    let add_mat = |w: &mut GgufWriter, name: String, m: Vec<Vec<f32>>| -> Vec<Vec<f32>> {
        let (rows, cols) = (m.len(), m[0].len());
        let ty = if name.ends_with("attn_v.weight") { v_ty } else { ty };
        match ty {
            GgmlType::Q8_0 => {
                let mut bytes = Vec::new();
                let mut deq = Vec::new();
                for r in &m {
                    let (b, d) = q8_0_row(r);
                    bytes.extend(b);
                    deq.push(d);
                }
                w.add_tensor(name, GgmlType::Q8_0, &[cols as u64, rows as u64], bytes);
                deq
            }
            _ => {
                let flat: Vec<f32> = m.iter().flatten().copied().collect();
                w.add_f32_tensor(name, &[cols as u64, rows as u64], &flat);
                m
            }
        }
    };
    let add_vec = |w: &mut GgufWriter, name: String, v: &[f32]| {
        w.add_f32_tensor(name, &[v.len() as u64], v);
    };

    let (h, hd) = (shape.hidden, shape.head_dim);
    let (qd, kvd) = (shape.heads * hd, shape.kv_heads * hd);
    let embed = add_mat(&mut w, "token_embd.weight".into(), g.mat(shape.vocab, h));
    let mut layers = Vec::new();
    for i in 0..shape.layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        let attn_norm = g.norm(h);
        add_vec(&mut w, n("attn_norm.weight"), &attn_norm);
        let wq = add_mat(&mut w, n("attn_q.weight"), g.mat(qd, h));
        let wk = add_mat(&mut w, n("attn_k.weight"), g.mat(kvd, h));
        let wv = add_mat(&mut w, n("attn_v.weight"), g.mat(kvd, h));
        let wo = add_mat(&mut w, n("attn_output.weight"), g.mat(h, qd));
        let bias = (family == Family::Qwen2).then(|| {
            let b = [g.norm(qd), g.norm(kvd), g.norm(kvd)].map(|v| v.iter().map(|x| x - 1.0).collect::<Vec<f32>>());
            add_vec(&mut w, n("attn_q.bias"), &b[0]);
            add_vec(&mut w, n("attn_k.bias"), &b[1]);
            add_vec(&mut w, n("attn_v.bias"), &b[2]);
            b
        });
        let qk_norm = (family == Family::Qwen3).then(|| {
            let b = [g.norm(hd), g.norm(hd)];
            add_vec(&mut w, n("attn_q_norm.weight"), &b[0]);
            add_vec(&mut w, n("attn_k_norm.weight"), &b[1]);
            b
        });
        let ffn_norm = g.norm(h);
        add_vec(&mut w, n("ffn_norm.weight"), &ffn_norm);
        let gate = add_mat(&mut w, n("ffn_gate.weight"), g.mat(shape.ffn, h));
        let up = add_mat(&mut w, n("ffn_up.weight"), g.mat(shape.ffn, h));
        let down = add_mat(&mut w, n("ffn_down.weight"), g.mat(h, shape.ffn));
        layers.push(RefLayer { attn_norm, wq, wk, wv, wo, bias, qk_norm, ffn_norm, gate, up, down });
    }
    let norm = g.norm(h);
    add_vec(&mut w, "output_norm.weight".into(), &norm);
    // Llama: untied head; Qwen: tied (no output.weight), so both paths are covered.
    let lm_head = if family == Family::Llama {
        add_mat(&mut w, "output.weight".into(), g.mat(shape.vocab, h))
    } else {
        embed.clone()
    };
    let bytes = w.to_bytes().expect("serialise synthetic gguf");
    let files = ModelFiles::Gguf(GgufFile::from_bytes(bytes).expect("parse synthetic gguf"));
    let reference = RefModel {
        hidden: h,
        n_heads: shape.heads,
        n_kv_heads: shape.kv_heads,
        head_dim: hd,
        eps: 1e-5,
        theta: 10000.0,
        interleaved: family == Family::Llama,
        embed,
        layers,
        norm,
        lm_head,
    };
    (Arc::new(files), reference)
}

/// Random token ids below `vocab`.
pub fn tokens(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| r.next_u32() % vocab as u32).collect()
}
