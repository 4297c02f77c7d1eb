//! A summary of a GGUF file for people and scripts: architecture, hyper-parameters, tokenizer,
//! the tensor table, and totals per tensor group and per type. `spillwayd inspect` prints it as
//! an aligned text report or as JSON.

use std::fmt::{self, Write};

use serde::Serialize;

use super::reader::GgufFile;
use super::value::{Array, Value};

/// Arrays up to this length are shown in full; longer ones as their type and length.
const SHORT_ARRAY: usize = 16;

/// Token type of control tokens (`LLAMA_TOKEN_TYPE_CONTROL`).
const CONTROL: i32 = 3;

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub path: String,
    pub version: u32,
    pub file_size: u64,
    pub alignment: u64,
    pub data_offset: u64,
    pub architecture: Option<String>,
    pub name: Option<String>,
    pub file_type: Option<FileType>,
    /// `general.*` entries other than the name, architecture and file type.
    pub general: Vec<Entry>,
    /// The `{architecture}.*` entries, in file order.
    pub hyperparameters: Vec<Entry>,
    pub tokenizer: Option<TokenizerSummary>,
    pub tensors: Vec<TensorRow>,
    pub groups: Vec<Total<Group>>,
    pub types: Vec<Total<String>>,
    pub total_bytes: u64,
    pub total_params: u64,
}

/// A metadata entry; long arrays are summarised as `{"array": type, "len": n}`.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub key: String,
    pub value: serde_json::Value,
}

#[derive(Debug, Clone, Serialize)]
pub struct FileType {
    pub id: u32,
    /// llama.cpp's name for it, e.g. `Q4_K_M`.
    pub name: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenRef {
    pub id: u64,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenizerSummary {
    pub model: Option<String>,
    pub pre: Option<String>,
    pub vocab_size: usize,
    pub merges: Option<usize>,
    pub has_scores: bool,
    pub control_tokens: usize,
    pub bos: Option<TokenRef>,
    pub eos: Option<TokenRef>,
    pub unk: Option<TokenRef>,
    pub pad: Option<TokenRef>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub has_chat_template: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct TensorRow {
    pub name: String,
    #[serde(rename = "type")]
    pub ggml_type: String,
    /// ggml order: `ne[0]` (the row length) first.
    pub shape: Vec<u64>,
    pub params: u64,
    pub bytes: u64,
    /// Offset inside the data section.
    pub offset: u64,
    pub group: Group,
}

/// What part of the model a tensor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    Embeddings,
    Attention,
    DenseFfn,
    Router,
    RoutedExperts,
    SharedExperts,
    Norms,
    Output,
    Other,
}

impl Group {
    /// Classifies a tensor by its llama.cpp name (`blk.N.` prefix and suffix stripped).
    pub fn of(name: &str) -> Group {
        let base = name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split_once('.'))
            .map_or(name, |(_, rest)| rest);
        let base = base
            .strip_suffix(".weight")
            .or_else(|| base.strip_suffix(".bias"))
            .unwrap_or(base);
        match base {
            "token_embd" | "pos_embd" | "token_types" => Group::Embeddings,
            "output" => Group::Output,
            _ if base.ends_with("_norm") || base == "norm" => Group::Norms,
            _ if base.contains("shexp") => Group::SharedExperts,
            _ if base.starts_with("ffn_gate_inp") || base.starts_with("exp_probs") => Group::Router,
            _ if base.ends_with("_exps") => Group::RoutedExperts,
            _ if base.starts_with("attn_") => Group::Attention,
            _ if base.starts_with("ffn_") => Group::DenseFfn,
            _ => Group::Other,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Group::Embeddings => "embeddings",
            Group::Attention => "attention",
            Group::DenseFfn => "dense FFN",
            Group::Router => "router",
            Group::RoutedExperts => "experts (routed)",
            Group::SharedExperts => "shared experts",
            Group::Norms => "norms",
            Group::Output => "output",
            Group::Other => "other",
        }
    }
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Tensors, parameters and bytes of one group or type.
#[derive(Debug, Clone, Serialize)]
pub struct Total<K> {
    pub key: K,
    pub tensors: usize,
    pub params: u64,
    pub bytes: u64,
}

fn add_to<K: PartialEq>(totals: &mut Vec<Total<K>>, key: K, params: u64, bytes: u64) {
    match totals.iter_mut().find(|t| t.key == key) {
        Some(t) => {
            t.tensors += 1;
            t.params += params;
            t.bytes += bytes;
        }
        None => totals.push(Total {
            key,
            tensors: 1,
            params,
            bytes,
        }),
    }
}

/// llama.cpp's `llama_ftype` names in id order; `-` marks retired ids.
const FILE_TYPE_NAMES: &str = "F32 F16 Q4_0 Q4_1 - - - Q8_0 Q5_0 Q5_1 Q2_K Q3_K_S Q3_K_M Q3_K_L \
    Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K IQ2_XXS IQ2_XS Q2_K_S IQ3_XS IQ3_XXS IQ1_S IQ4_NL IQ3_S IQ3_M \
    IQ2_S IQ2_M IQ4_XS IQ1_M BF16 - - - TQ1_0 TQ2_0 MXFP4_MOE";

/// llama.cpp's name of a `general.file_type`, e.g. 15 → `Q4_K_M`.
pub fn file_type_name(id: u32) -> Option<&'static str> {
    FILE_TYPE_NAMES
        .split_whitespace()
        .nth(usize::try_from(id).ok()?)
        .filter(|&n| n != "-")
}

fn json_array(a: &Array) -> serde_json::Value {
    use serde_json::json;
    if a.len() > SHORT_ARRAY {
        return json!({ "array": a.element_type().name(), "len": a.len() });
    }
    match a {
        Array::U8(v) => json!(v),
        Array::I8(v) => json!(v),
        Array::U16(v) => json!(v),
        Array::I16(v) => json!(v),
        Array::U32(v) => json!(v),
        Array::I32(v) => json!(v),
        Array::F32(v) => json!(v.iter().map(|&x| f32_json(x)).collect::<Vec<_>>()),
        Array::Bool(v) => json!(v),
        Array::String(v) => json!(v),
        Array::U64(v) => json!(v),
        Array::I64(v) => json!(v),
        Array::F64(v) => json!(v),
    }
}

/// An f32 as the shortest decimal that reads back as it (`1e-6`, not `9.99999997e-7`).
fn f32_json(x: f32) -> serde_json::Value {
    x.to_string()
        .parse::<f64>()
        .map_or(serde_json::Value::Null, serde_json::Value::from)
}

/// A metadata value as JSON (long arrays summarised).
pub fn json_value(v: &Value) -> serde_json::Value {
    use serde_json::json;
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::F32(x) => f32_json(*x),
        Value::Bool(x) => json!(x),
        Value::String(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Array(a) => json_array(a),
    }
}

impl Summary {
    /// Summarises an opened file; `path` is only recorded.
    pub fn new(path: &str, file: &GgufFile) -> Summary {
        let md = file.metadata();
        let arch = file.architecture().map(str::to_owned);
        let prefix = arch.as_ref().map(|a| format!("{a}."));
        let entry = |k: &str, v: &Value| Entry {
            key: k.to_owned(),
            value: json_value(v),
        };
        let mut general = Vec::new();
        let mut hyperparameters = Vec::new();
        for (k, v) in md.iter() {
            if prefix.as_deref().is_some_and(|p| k.starts_with(p)) {
                hyperparameters.push(entry(k, v));
            } else if k.starts_with("general.")
                && !matches!(
                    k,
                    "general.architecture" | "general.name" | "general.file_type"
                )
            {
                general.push(entry(k, v));
            }
        }
        let file_type = md
            .opt_u32("general.file_type")
            .ok()
            .flatten()
            .map(|id| FileType {
                id,
                name: file_type_name(id),
            });

        let mut tensors = Vec::with_capacity(file.tensors().len());
        let mut groups = Vec::new();
        let mut types = Vec::new();
        for t in file.tensors() {
            let group = Group::of(&t.name);
            add_to(&mut groups, group, t.n_elements, t.n_bytes);
            add_to(
                &mut types,
                t.ggml_type.name().to_owned(),
                t.n_elements,
                t.n_bytes,
            );
            tensors.push(TensorRow {
                name: t.name.clone(),
                ggml_type: t.ggml_type.name().to_owned(),
                shape: t.dims.clone(),
                params: t.n_elements,
                bytes: t.n_bytes,
                offset: t.offset,
                group,
            });
        }
        groups.sort_by_key(|g| g.key);
        types.sort_by_key(|t| std::cmp::Reverse(t.bytes));

        Summary {
            path: path.to_owned(),
            version: file.version(),
            file_size: file.file_size(),
            alignment: file.alignment(),
            data_offset: file.data_offset(),
            architecture: arch,
            name: md.opt_str("general.name").ok().flatten().map(str::to_owned),
            file_type,
            general,
            hyperparameters,
            tokenizer: tokenizer_summary(file),
            total_bytes: tensors.iter().map(|t| t.bytes).sum(),
            total_params: tensors.iter().map(|t| t.params).sum(),
            tensors,
            groups,
            types,
        }
    }
}

fn tokenizer_summary(file: &GgufFile) -> Option<TokenizerSummary> {
    let md = file.metadata();
    let key = |k: &str| format!("tokenizer.ggml.{k}");
    let tokens = md.opt_string_array(&key("tokens")).ok().flatten();
    let model = md.opt_str(&key("model")).ok().flatten();
    if tokens.is_none() && model.is_none() {
        return None;
    }
    let tokens = tokens.unwrap_or(&[]);
    let token = |k: &str| {
        md.opt_u64(&key(k)).ok().flatten().map(|id| TokenRef {
            id,
            text: usize::try_from(id)
                .ok()
                .and_then(|i| tokens.get(i))
                .cloned(),
        })
    };
    let control_tokens = md
        .opt_i32_array(&key("token_type"))
        .ok()
        .flatten()
        .map_or(0, |types| types.iter().filter(|&&t| t == CONTROL).count());
    Some(TokenizerSummary {
        model: model.map(str::to_owned),
        pre: md.opt_str(&key("pre")).ok().flatten().map(str::to_owned),
        vocab_size: tokens.len(),
        merges: md.get(&key("merges")).and_then(|v| match v {
            Value::Array(a) => Some(a.len()),
            _ => None,
        }),
        has_scores: md.contains_key(&key("scores")),
        control_tokens,
        bos: token("bos_token_id"),
        eos: token("eos_token_id"),
        unk: token("unknown_token_id"),
        pad: token("padding_token_id"),
        add_bos: md.opt_bool(&key("add_bos_token")).ok().flatten(),
        add_eos: md.opt_bool(&key("add_eos_token")).ok().flatten(),
        has_chat_template: md.contains_key("tokenizer.chat_template"),
    })
}

/// `1536` → `"1.5 KiB"`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

/// `1_234_000_000` → `"1.23 B"`.
pub fn human_count(n: u64) -> String {
    match n {
        0..=9_999 => n.to_string(),
        10_000..=999_999 => format!("{:.1} K", n as f64 / 1e3),
        1_000_000..=999_999_999 => format!("{:.2} M", n as f64 / 1e6),
        _ => format!("{:.2} B", n as f64 / 1e9),
    }
}

fn bits_per_weight(bytes: u64, params: u64) -> f64 {
    if params == 0 {
        0.0
    } else {
        bytes as f64 * 8.0 / params as f64
    }
}

fn display_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) if s.len() > 72 => {
            let cut = (0..=72).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
            format!("{:?}… ({} bytes)", &s[..cut], s.len())
        }
        serde_json::Value::String(s) => format!("{s:?}"),
        serde_json::Value::Object(o) => format!(
            "[{}; {}]",
            o.get("array").and_then(|t| t.as_str()).unwrap_or("?"),
            o.get("len").map_or(String::new(), |n| n.to_string())
        ),
        other => other.to_string(),
    }
}

fn token_text(t: &Option<TokenRef>) -> String {
    match t {
        Some(TokenRef { id, text: Some(s) }) => format!("{id} {s:?}"),
        Some(TokenRef { id, text: None }) => format!("{id} (out of range)"),
        None => "-".to_owned(),
    }
}

impl Summary {
    /// The aligned text report `spillwayd inspect` prints.
    pub fn write_text(&self, out: &mut impl Write) -> fmt::Result {
        writeln!(out, "file        {}", self.path)?;
        writeln!(
            out,
            "            {} ({} bytes), GGUF v{}, alignment {}, data at {:#x}",
            human_bytes(self.file_size),
            self.file_size,
            self.version,
            self.alignment,
            self.data_offset
        )?;
        let ft = self.file_type.as_ref().map_or("-".to_owned(), |f| {
            format!("{} ({})", f.name.unwrap_or("unknown"), f.id)
        });
        writeln!(
            out,
            "model       {}  [{}]  file type {ft}",
            self.name.as_deref().unwrap_or("-"),
            self.architecture.as_deref().unwrap_or("no architecture")
        )?;
        writeln!(
            out,
            "size        {} parameters, {} tensors, {} of tensor data ({:.2} bits/weight)",
            human_count(self.total_params),
            self.tensors.len(),
            human_bytes(self.total_bytes),
            bits_per_weight(self.total_bytes, self.total_params)
        )?;
        let entries = self.general.iter().chain(&self.hyperparameters);
        let width = entries.clone().map(|e| e.key.len()).max().unwrap_or(0);
        writeln!(out, "\nmetadata")?;
        for e in entries {
            writeln!(out, "  {:<width$}  {}", e.key, display_value(&e.value))?;
        }
        if let Some(t) = &self.tokenizer {
            writeln!(out, "\ntokenizer")?;
            writeln!(
                out,
                "  model {}{}, {} tokens ({} control), {} merges{}{}",
                t.model.as_deref().unwrap_or("-"),
                t.pre
                    .as_ref()
                    .map_or(String::new(), |p| format!(" (pre {p})")),
                t.vocab_size,
                t.control_tokens,
                t.merges.map_or("no".to_owned(), |m| m.to_string()),
                if t.has_scores { ", scores" } else { "" },
                if t.has_chat_template {
                    ", chat template"
                } else {
                    ""
                },
            )?;
            let flag = |b: Option<bool>| b.map_or("-".to_owned(), |b| b.to_string());
            writeln!(
                out,
                "  bos {}  eos {}  unk {}  pad {}  add_bos {}  add_eos {}",
                token_text(&t.bos),
                token_text(&t.eos),
                token_text(&t.unk),
                token_text(&t.pad),
                flag(t.add_bos),
                flag(t.add_eos)
            )?;
        }
        writeln!(out, "\nby group")?;
        let labels: Vec<String> = self.groups.iter().map(|g| g.key.to_string()).collect();
        self.write_totals(out, "group", &labels, &self.groups)?;
        writeln!(out, "\nby type")?;
        let labels: Vec<String> = self.types.iter().map(|t| t.key.clone()).collect();
        self.write_totals(out, "type", &labels, &self.types)?;
        writeln!(out, "\ntensors")?;
        self.write_tensor_table(out)
    }

    fn write_totals<K>(
        &self,
        out: &mut impl Write,
        title: &str,
        labels: &[String],
        totals: &[Total<K>],
    ) -> fmt::Result {
        let w = labels
            .iter()
            .map(|l| l.len())
            .max()
            .unwrap_or(0)
            .max(title.len());
        writeln!(
            out,
            "  {title:<w$}  {:>7}  {:>10}  {:>11}  {:>6}  {:>5}",
            "tensors", "params", "bytes", "share", "bpw"
        )?;
        for (label, t) in labels.iter().zip(totals) {
            let share = if self.total_bytes == 0 {
                0.0
            } else {
                100.0 * t.bytes as f64 / self.total_bytes as f64
            };
            writeln!(
                out,
                "  {label:<w$}  {:>7}  {:>10}  {:>11}  {:>5.1}%  {:>5.2}",
                t.tensors,
                human_count(t.params),
                human_bytes(t.bytes),
                share,
                bits_per_weight(t.bytes, t.params)
            )?;
        }
        Ok(())
    }

    fn write_tensor_table(&self, out: &mut impl Write) -> fmt::Result {
        let shapes: Vec<String> = self
            .tensors
            .iter()
            .map(|t| {
                let dims: Vec<String> = t.shape.iter().map(u64::to_string).collect();
                dims.join(" x ")
            })
            .collect();
        let wn = self
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(0)
            .max(4);
        let ws = shapes.iter().map(String::len).max().unwrap_or(0).max(5);
        let wt = self
            .tensors
            .iter()
            .map(|t| t.ggml_type.len())
            .max()
            .unwrap_or(0)
            .max(4);
        writeln!(
            out,
            "  {:<wn$}  {:<wt$}  {:<ws$}  {:>11}  group",
            "name", "type", "shape", "bytes"
        )?;
        for (t, shape) in self.tensors.iter().zip(&shapes) {
            writeln!(
                out,
                "  {:<wn$}  {:<wt$}  {:<ws$}  {:>11}  {}",
                t.name,
                t.ggml_type,
                shape,
                human_bytes(t.bytes),
                t.group
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_fall_in_their_groups() {
        for (name, group) in [
            ("token_embd.weight", Group::Embeddings),
            ("output.weight", Group::Output),
            ("output_norm.weight", Group::Norms),
            ("blk.3.attn_q_norm.weight", Group::Norms),
            ("blk.3.attn_q.weight", Group::Attention),
            ("blk.3.attn_output.weight", Group::Attention),
            ("blk.3.ffn_gate_inp.weight", Group::Router),
            ("blk.3.ffn_gate_inp_shexp.weight", Group::SharedExperts),
            ("blk.3.ffn_up_exps.weight", Group::RoutedExperts),
            ("blk.3.ffn_down_shexp.weight", Group::SharedExperts),
            ("blk.3.ffn_down.weight", Group::DenseFfn),
            ("blk.12.attn_v.bias", Group::Attention),
            ("rope_freqs.weight", Group::Other),
        ] {
            assert_eq!(Group::of(name), group, "{name}");
        }
    }

    #[test]
    fn human_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_count(1_235_814_400), "1.24 B");
        assert_eq!(human_count(3_410_000), "3.41 M");
        assert_eq!(file_type_name(15), Some("Q4_K_M"));
        assert_eq!(file_type_name(32), Some("BF16"));
        assert_eq!(file_type_name(4), None);
        assert_eq!(file_type_name(99), None);
    }
}
