//! Raw little-endian GGUF bytes for reader tests, written by hand rather than by the production
//! writer, so that tests can build files the writer would refuse to produce.

#![allow(dead_code)]

/// ggml type ids used by the tests.
pub const F32: u32 = 0;
pub const Q8_0: u32 = 8;

/// GGUF metadata value type ids.
pub mod vt {
    pub const U8: u32 = 0;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
}

/// An append-only byte buffer with GGUF's primitive encodings.
#[derive(Default, Clone)]
pub struct Bytes(pub Vec<u8>);

impl Bytes {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.raw(&v.to_le_bytes())
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.raw(&v.to_le_bytes())
    }

    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }

    /// A GGUF string: u64 byte length, then the bytes.
    pub fn str(&mut self, s: impl AsRef<[u8]>) -> &mut Self {
        let s = s.as_ref();
        self.u64(s.len() as u64).raw(s)
    }

    /// Magic, version, tensor count, metadata entry count.
    pub fn header(&mut self, version: u32, n_tensors: u64, n_kv: u64) -> &mut Self {
        self.raw(b"GGUF").u32(version).u64(n_tensors).u64(n_kv)
    }

    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(vt::U32).u32(v)
    }

    pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.str(key).u32(vt::STRING).str(v)
    }

    pub fn tensor_info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        dims.iter().for_each(|&d| {
            self.u64(d);
        });
        self.u32(ty).u64(offset)
    }

    pub fn pad_to(&mut self, align: usize) -> &mut Self {
        let len = self.0.len().next_multiple_of(align);
        self.0.resize(len, 0);
        self
    }

    pub fn zeros(&mut self, n: usize) -> &mut Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn to_vec(&self) -> Vec<u8> {
        self.0.clone()
    }
}

/// A metadata value of [`RawGguf`].
#[derive(Clone, Debug)]
pub enum Kv {
    U32(u32),
    U64(u64),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
    F32s(Vec<f32>),
    I32s(Vec<i32>),
}

impl Kv {
    fn encode(&self, b: &mut Bytes) {
        match self {
            Kv::U32(v) => b.u32(vt::U32).u32(*v),
            Kv::U64(v) => b.u32(vt::U64).u64(*v),
            Kv::F32(v) => b.u32(vt::F32).raw(&v.to_le_bytes()),
            Kv::Str(s) => b.u32(vt::STRING).str(s),
            Kv::Strs(v) => {
                b.u32(vt::ARRAY).u32(vt::STRING).u64(v.len() as u64);
                v.iter().for_each(|s| {
                    b.str(s);
                });
                b
            }
            Kv::F32s(v) => {
                b.u32(vt::ARRAY).u32(vt::F32).u64(v.len() as u64);
                v.iter().for_each(|x| {
                    b.raw(&x.to_le_bytes());
                });
                b
            }
            Kv::I32s(v) => {
                b.u32(vt::ARRAY).u32(vt::I32).u64(v.len() as u64);
                v.iter().for_each(|x| {
                    b.raw(&x.to_le_bytes());
                });
                b
            }
        };
    }
}

#[derive(Clone, Debug)]
pub struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
}

impl RawTensor {
    /// Bytes of data, for the few types the tests use.
    pub fn n_bytes(&self) -> u64 {
        let (block, bytes) = match self.ty {
            F32 => (1, 4),
            Q8_0 => (32, 34),
            other => panic!("test builder does not size ggml type {other}"),
        };
        self.dims.iter().product::<u64>() / block * bytes
    }
}

/// A whole file: metadata and tensors in order, offsets packed at the alignment, data zeroed.
#[derive(Clone, Debug)]
pub struct RawGguf {
    pub version: u32,
    pub kvs: Vec<(String, Kv)>,
    pub tensors: Vec<RawTensor>,
    pub alignment: u64,
}

impl Default for RawGguf {
    fn default() -> Self {
        RawGguf {
            version: 3,
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
        }
    }
}

impl RawGguf {
    /// Sets `key`, replacing its value in place when present.
    pub fn set(&mut self, key: &str, v: Kv) -> &mut Self {
        match self.kvs.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = v,
            None => self.kvs.push((key.to_owned(), v)),
        }
        self
    }

    pub fn remove_kv(&mut self, key: &str) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self
    }

    pub fn add_tensor(&mut self, name: &str, dims: &[u64], ty: u32) -> &mut Self {
        self.tensors.push(RawTensor {
            name: name.to_owned(),
            dims: dims.to_vec(),
            ty,
        });
        self
    }

    pub fn remove_tensor(&mut self, name: &str) -> &mut Self {
        let before = self.tensors.len();
        self.tensors.retain(|t| t.name != name);
        assert_eq!(self.tensors.len() + 1, before, "no tensor {name}");
        self
    }

    pub fn tensor_mut(&mut self, name: &str) -> &mut RawTensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .expect("tensor exists")
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Bytes::new();
        b.header(
            self.version,
            self.tensors.len() as u64,
            self.kvs.len() as u64,
        );
        for (k, v) in &self.kvs {
            b.str(k);
            v.encode(&mut b);
        }
        let mut offset = 0;
        for t in &self.tensors {
            b.tensor_info(&t.name, &t.dims, t.ty, offset);
            offset = (offset + t.n_bytes()).next_multiple_of(self.alignment);
        }
        b.pad_to(self.alignment as usize).zeros(offset as usize);
        b.0
    }
}

/// Hyperparameters of a tiny synthetic model.
#[derive(Clone, Debug)]
pub struct Spec {
    pub arch: &'static str,
    pub n_embd: u64,
    pub n_blocks: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub n_ff: u64,
    pub n_vocab: u64,
    /// 0 for a dense model.
    pub n_expert: u64,
    pub n_expert_used: u64,
    /// qwen2moe's shared expert.
    pub shared_expert: bool,
}

pub fn llama_spec() -> Spec {
    Spec {
        arch: "llama",
        n_embd: 8,
        n_blocks: 2,
        n_head: 2,
        n_head_kv: 1,
        n_ff: 16,
        n_vocab: 10,
        n_expert: 0,
        n_expert_used: 0,
        shared_expert: false,
    }
}

pub fn qwen3moe_spec() -> Spec {
    Spec {
        arch: "qwen3moe",
        n_expert: 4,
        n_expert_used: 2,
        ..llama_spec()
    }
}

pub fn qwen2moe_spec() -> Spec {
    Spec {
        arch: "qwen2moe",
        shared_expert: true,
        ..qwen3moe_spec()
    }
}

/// A structurally valid model of `s` whose metadata agrees with its tensors (all F32).
pub fn model(s: &Spec) -> RawGguf {
    let mut g = RawGguf::default();
    let a = s.arch;
    let head_dim = s.n_embd / s.n_head;
    let tokens: Vec<String> = (0..s.n_vocab).map(|i| format!("t{i}")).collect();
    g.set("general.architecture", Kv::Str(a.into()))
        .set(&format!("{a}.block_count"), Kv::U32(s.n_blocks as u32))
        .set(&format!("{a}.embedding_length"), Kv::U32(s.n_embd as u32))
        .set(&format!("{a}.feed_forward_length"), Kv::U32(s.n_ff as u32))
        .set(
            &format!("{a}.attention.head_count"),
            Kv::U32(s.n_head as u32),
        )
        .set(
            &format!("{a}.attention.head_count_kv"),
            Kv::U32(s.n_head_kv as u32),
        )
        .set(&format!("{a}.rope.freq_base"), Kv::F32(10_000.0))
        .set("tokenizer.ggml.model", Kv::Str("gpt2".into()))
        .set("tokenizer.ggml.tokens", Kv::Strs(tokens))
        .set(
            "tokenizer.ggml.scores",
            Kv::F32s(vec![0.0; s.n_vocab as usize]),
        )
        .set(
            "tokenizer.ggml.token_type",
            Kv::I32s(vec![1; s.n_vocab as usize]),
        )
        .set("tokenizer.ggml.bos_token_id", Kv::U32(1))
        .set("tokenizer.ggml.eos_token_id", Kv::U32(2));
    if s.n_expert > 0 {
        g.set(&format!("{a}.expert_count"), Kv::U32(s.n_expert as u32))
            .set(
                &format!("{a}.expert_used_count"),
                Kv::U32(s.n_expert_used as u32),
            )
            .set(
                &format!("{a}.expert_feed_forward_length"),
                Kv::U32(s.n_ff as u32),
            );
    }

    let (e, v, ff, x) = (s.n_embd, s.n_vocab, s.n_ff, s.n_expert);
    g.add_tensor("token_embd.weight", &[e, v], F32);
    for i in 0..s.n_blocks {
        let n = |part: &str| format!("blk.{i}.{part}.weight");
        g.add_tensor(&n("attn_norm"), &[e], F32)
            .add_tensor(&n("attn_q"), &[e, s.n_head * head_dim], F32)
            .add_tensor(&n("attn_k"), &[e, s.n_head_kv * head_dim], F32)
            .add_tensor(&n("attn_v"), &[e, s.n_head_kv * head_dim], F32)
            .add_tensor(&n("attn_output"), &[s.n_head * head_dim, e], F32)
            .add_tensor(&n("ffn_norm"), &[e], F32);
        if x == 0 {
            g.add_tensor(&n("ffn_gate"), &[e, ff], F32)
                .add_tensor(&n("ffn_up"), &[e, ff], F32)
                .add_tensor(&n("ffn_down"), &[ff, e], F32);
        } else {
            g.add_tensor(&n("ffn_gate_inp"), &[e, x], F32)
                .add_tensor(&n("ffn_gate_exps"), &[e, ff, x], F32)
                .add_tensor(&n("ffn_up_exps"), &[e, ff, x], F32)
                .add_tensor(&n("ffn_down_exps"), &[ff, e, x], F32);
        }
        if s.shared_expert {
            g.add_tensor(&n("ffn_gate_inp_shexp"), &[e], F32)
                .add_tensor(&n("ffn_gate_shexp"), &[e, ff], F32)
                .add_tensor(&n("ffn_up_shexp"), &[e, ff], F32)
                .add_tensor(&n("ffn_down_shexp"), &[ff, e], F32);
        }
    }
    g.add_tensor("output_norm.weight", &[e], F32)
        .add_tensor("output.weight", &[e, v], F32);
    g
}
