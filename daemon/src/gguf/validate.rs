//! Consistency of a known architecture's metadata with its tensors.
//!
//! The reader proves a file is well formed; this proves it describes a model we could run: every
//! hyperparameter the graph will use agrees with the tensor shapes it indexes, and every tensor
//! the graph needs is there. Catching a contradiction here turns what would be an out-of-bounds
//! read or a silently wrong result deep inside a kernel into an error naming the key and tensor.
//!
//! Shapes follow llama.cpp (ggml order, `ne[0]` first): `token_embd` is `[n_embd, n_vocab]`,
//! `attn_q` is `[n_embd, n_head * head_dim_k]`, `ffn_down` is `[n_ff, n_embd]`, expert tensors
//! carry the expert index on axis 2. Architectures not in [`KNOWN_ARCHITECTURES`] are not checked.

use std::collections::HashMap;

use super::error::GgufError;
use super::reader::{Header, Metadata, TensorInfo};

/// Architectures whose tensors and hyperparameters are checked.
pub const KNOWN_ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe"];

/// Checks a parsed header of a known architecture; other architectures (or files without
/// `general.architecture`) pass unchecked.
pub fn validate_architecture(header: &Header) -> Result<(), GgufError> {
    let md = &header.metadata;
    let Some(arch) = md.opt_str("general.architecture")? else {
        return Ok(());
    };
    if !KNOWN_ARCHITECTURES.contains(&arch) {
        return Ok(());
    }
    let model = Model::new(arch, header)?;
    model.check_vocabulary()?;
    for block in 0..model.n_blocks {
        model.check_block(block)?;
    }
    model.check_no_tensor_beyond_last_block()
}

/// An expected size and the metadata key it comes from, for error messages.
struct Expect {
    value: u64,
    key: String,
}

/// Hyperparameters read from the metadata, as the sizes they imply.
struct Model<'h> {
    arch: &'h str,
    md: &'h Metadata,
    /// In file order, for deterministic error reports.
    all_tensors: &'h [TensorInfo],
    tensors: HashMap<&'h str, &'h TensorInfo>,
    n_blocks: u64,
    embd: Expect,
    vocab: Expect,
    q_out: Expect,
    k_out: Expect,
    v_out: Expect,
    o_in: Expect,
    head_dim_k: Expect,
    ff: Option<Expect>,
    moe: Option<Experts>,
}

struct Experts {
    count: Expect,
    ff: Option<Expect>,
    /// qwen2moe's shared expert, beside the routed ones.
    shared: Option<Option<Expect>>,
}

impl<'h> Model<'h> {
    fn new(arch: &'h str, header: &'h Header) -> Result<Self, GgufError> {
        let md = &header.metadata;
        let tensors = header
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t))
            .collect();
        let key = |suffix: &str| format!("{arch}.{suffix}");
        let positive = |k: String| -> Result<Expect, GgufError> {
            let value = md.get_u64(&k)?;
            if value == 0 {
                return Err(invalid(&k, value, "must be at least 1"));
            }
            Ok(Expect { value, key: k })
        };
        let optional = |k: String| -> Result<Option<Expect>, GgufError> {
            Ok(md.opt_u64(&k)?.map(|value| Expect { value, key: k }))
        };

        let n_blocks = positive(key("block_count"))?.value;
        let embd = positive(key("embedding_length"))?;
        let n_head = positive(key("attention.head_count"))?;
        let n_head_kv = match optional(key("attention.head_count_kv"))? {
            Some(kv) if kv.value == 0 || n_head.value % kv.value != 0 => {
                return Err(invalid(
                    &kv.key,
                    kv.value,
                    "must divide attention.head_count",
                ));
            }
            Some(kv) => kv,
            None => Expect {
                value: n_head.value,
                key: n_head.key.clone(),
            },
        };
        // llama.cpp's default head size is n_embd / n_head when key_length/value_length are absent.
        let head_dim = |suffix: &str| -> Result<Expect, GgufError> {
            if let Some(d) = optional(key(suffix))? {
                return Ok(d);
            }
            if embd.value % n_head.value != 0 {
                return Err(invalid(
                    &n_head.key,
                    n_head.value,
                    "must divide embedding_length",
                ));
            }
            Ok(Expect {
                value: embd.value / n_head.value,
                key: n_head.key.clone(),
            })
        };
        let head_dim_k = head_dim("attention.key_length")?;
        let head_dim_v = head_dim("attention.value_length")?;
        let times = |heads: &Expect, dim: &Expect| -> Result<Expect, GgufError> {
            let value = heads
                .value
                .checked_mul(dim.value)
                .ok_or_else(|| invalid(&heads.key, heads.value, "times the head size overflows"))?;
            Ok(Expect {
                value,
                key: heads.key.clone(),
            })
        };
        let q_out = times(&n_head, &head_dim_k)?;
        let k_out = times(&n_head_kv, &head_dim_k)?;
        let v_out = times(&n_head_kv, &head_dim_v)?;
        let o_in = times(&n_head, &head_dim_v)?;
        let ff = optional(key("feed_forward_length"))?;

        let n_expert = md.opt_u64(&key("expert_count"))?.unwrap_or(0);
        let moe = if arch.ends_with("moe") || n_expert > 0 {
            let count = positive(key("expert_count"))?;
            let used = positive(key("expert_used_count"))?;
            if used.value > count.value {
                return Err(invalid(&used.key, used.value, "exceeds expert_count"));
            }
            // Mixtral-style llama files size their experts with feed_forward_length.
            let ff_exp = match optional(key("expert_feed_forward_length"))? {
                Some(f) => Some(f),
                None if arch == "llama" => optional(key("feed_forward_length"))?,
                None => None,
            };
            let shared = match arch {
                "qwen2moe" => Some(optional(key("expert_shared_feed_forward_length"))?),
                _ => None,
            };
            Some(Experts {
                count,
                ff: ff_exp,
                shared,
            })
        } else {
            None
        };

        let mut model = Model {
            arch,
            md,
            all_tensors: &header.tensors,
            tensors,
            n_blocks,
            vocab: Expect {
                value: 0,
                key: String::new(),
            },
            embd,
            q_out,
            k_out,
            v_out,
            o_in,
            head_dim_k,
            ff,
            moe,
        };
        model.vocab = model.vocabulary()?;
        model.check_globals()?;
        Ok(model)
    }

    /// The vocabulary size: the token list when present, else `token_embd`'s rows.
    fn vocabulary(&self) -> Result<Expect, GgufError> {
        let embd = self.require("token_embd.weight")?;
        match self.md.opt_string_array("tokenizer.ggml.tokens")? {
            Some(tokens) => Ok(Expect {
                value: tokens.len() as u64,
                key: "tokenizer.ggml.tokens".into(),
            }),
            None => Ok(Expect {
                value: embd.dim(1),
                key: "token_embd.weight".into(),
            }),
        }
    }

    /// Tensors outside the blocks.
    fn check_globals(&self) -> Result<(), GgufError> {
        self.shape("token_embd.weight", &[Some(&self.embd), Some(&self.vocab)])?;
        self.shape("output_norm.weight", &[Some(&self.embd)])?;
        // Absent when the output projection is tied to the token embedding.
        if self.tensors.contains_key("output.weight") {
            self.shape("output.weight", &[Some(&self.embd), Some(&self.vocab)])?;
        }
        Ok(())
    }

    fn check_vocabulary(&self) -> Result<(), GgufError> {
        let vocab_size = self.vocab.value;
        if let Some(n) = self.md.opt_u64(&format!("{}.vocab_size", self.arch))? {
            if n != vocab_size {
                let key = format!("{}.vocab_size", self.arch);
                return Err(invalid(&key, n, "differs from the vocabulary size"));
            }
        }
        if self.md.contains_key("tokenizer.ggml.tokens") {
            for key in ["tokenizer.ggml.scores", "tokenizer.ggml.token_type"] {
                let Some(array) = self.md.opt_array(key)? else {
                    continue;
                };
                if array.len() as u64 != vocab_size {
                    return Err(GgufError::ArrayLengthMismatch {
                        key: key.into(),
                        len: array.len() as u64,
                        expected: vocab_size,
                        reference: "tokenizer.ggml.tokens".into(),
                    });
                }
            }
        }
        // Special tokens (bos, eos, unknown, padding, seperator, eot, ...) index the vocabulary.
        for (key, _) in self.md.iter() {
            if key.starts_with("tokenizer.ggml.") && key.ends_with("_token_id") {
                let id = self.md.get_u64(key)?;
                if id >= vocab_size {
                    return Err(GgufError::TokenIdOutOfRange {
                        key: key.into(),
                        id,
                        vocab_size,
                    });
                }
            }
        }
        Ok(())
    }

    fn check_block(&self, block: u64) -> Result<(), GgufError> {
        let name = |part: &str| format!("blk.{block}.{part}.weight");
        let embd = Some(&self.embd);
        self.shape(&name("attn_norm"), &[embd])?;
        self.shape(&name("attn_q"), &[embd, Some(&self.q_out)])?;
        self.shape(&name("attn_k"), &[embd, Some(&self.k_out)])?;
        self.shape(&name("attn_v"), &[embd, Some(&self.v_out)])?;
        self.shape(&name("attn_output"), &[Some(&self.o_in), embd])?;
        self.shape(&name("ffn_norm"), &[embd])?;
        // Qwen3's per-head norms over q and k, when present.
        for part in ["attn_q_norm", "attn_k_norm"] {
            if self.tensors.contains_key(name(part).as_str()) {
                self.shape(&name(part), &[Some(&self.head_dim_k)])?;
            }
        }
        let Some(moe) = &self.moe else {
            let ff = self.ff.as_ref();
            self.shape(&name("ffn_gate"), &[embd, ff])?;
            self.shape(&name("ffn_up"), &[embd, ff])?;
            return self.shape(&name("ffn_down"), &[ff, embd]);
        };
        let (experts, ff) = (Some(&moe.count), moe.ff.as_ref());
        self.shape(&name("ffn_gate_inp"), &[embd, experts])?;
        self.shape(&name("ffn_gate_exps"), &[embd, ff, experts])?;
        self.shape(&name("ffn_up_exps"), &[embd, ff, experts])?;
        self.shape(&name("ffn_down_exps"), &[ff, embd, experts])?;
        if let Some(shared_ff) = &moe.shared {
            let ff = shared_ff.as_ref();
            self.shape(&name("ffn_gate_shexp"), &[embd, ff])?;
            self.shape(&name("ffn_up_shexp"), &[embd, ff])?;
            self.shape(&name("ffn_down_shexp"), &[ff, embd])?;
        }
        Ok(())
    }

    /// A `blk.N.*` tensor with N past the last block means block_count is too small.
    fn check_no_tensor_beyond_last_block(&self) -> Result<(), GgufError> {
        for t in self.all_tensors {
            let block = t
                .name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|n| n.parse::<u64>().ok());
            if block.is_some_and(|b| b >= self.n_blocks) {
                return Err(GgufError::TensorBeyondBlockCount {
                    tensor: t.name.clone(),
                    block_count: self.n_blocks,
                });
            }
        }
        Ok(())
    }

    fn require(&self, name: &str) -> Result<&'h TensorInfo, GgufError> {
        self.tensors
            .get(name)
            .copied()
            .ok_or_else(|| GgufError::MissingTensor {
                arch: self.arch.to_owned(),
                tensor: name.to_owned(),
            })
    }

    /// Requires `name` and checks each axis against its expectation (`None`: unchecked); axes
    /// past `expected` must have size 1.
    fn shape(&self, name: &str, expected: &[Option<&Expect>]) -> Result<(), GgufError> {
        let t = self.require(name)?;
        for (axis, e) in expected.iter().enumerate() {
            let Some(e) = e else { continue };
            if t.dim(axis) != e.value {
                return Err(GgufError::ShapeMismatch {
                    tensor: name.to_owned(),
                    axis,
                    found: t.dim(axis),
                    expected: e.value,
                    key: e.key.clone(),
                });
            }
        }
        let rank = t.dims.iter().rposition(|&d| d != 1).map_or(0, |i| i + 1);
        if rank > expected.len() {
            return Err(GgufError::UnexpectedRank {
                tensor: name.to_owned(),
                found: rank,
                max: expected.len(),
            });
        }
        Ok(())
    }
}

fn invalid(key: &str, value: u64, reason: &'static str) -> GgufError {
    GgufError::InvalidMetadataValue {
        key: key.to_owned(),
        value,
        reason,
    }
}
