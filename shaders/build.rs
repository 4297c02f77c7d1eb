//! Compiles every shader variant of the table in `variants.rs` from GLSL to SPIR-V with glslang
//! (built from source by the `glslang` crate, so cooperative matrices are known), and writes the
//! typed `ShaderId` list that the runtime uses.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use glslang::include::{IncludeHandler, IncludeResult, IncludeType};
use glslang::{
    Compiler, CompilerOptions, ShaderInput, ShaderSource, ShaderStage, SourceLanguage,
    SpirvVersion, Target, VulkanVersion,
};

include!("variants.rs");

struct GlslDir(PathBuf);

impl IncludeHandler for GlslDir {
    fn include(
        &mut self,
        _ty: IncludeType,
        header: &str,
        _includer: &str,
        _depth: usize,
    ) -> Option<IncludeResult> {
        let path = self.0.join(header);
        let data = std::fs::read_to_string(&path).ok()?;
        Some(IncludeResult {
            name: path.display().to_string(),
            data,
        })
    }
}

fn compile(compiler: &Compiler, glsl_dir: &Path, v: &Variant) -> Vec<u32> {
    let path = glsl_dir.join(v.source);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    // `#include` needs this extension; adding it here keeps the sources plain GLSL.
    let text = text.replacen(
        "#version 450\n",
        "#version 450\n#extension GL_GOOGLE_include_directive : require\n",
        1,
    );
    let source = ShaderSource::from(text);
    let options = CompilerOptions {
        source_language: SourceLanguage::GLSL,
        target: Target::Vulkan {
            version: VulkanVersion::Vulkan1_3,
            spirv_version: SpirvVersion::SPIRV1_6,
        },
        ..CompilerOptions::default()
    };
    let mut defines: Vec<(&str, Option<&str>)> =
        v.defines.iter().map(|&(k, val)| (k, Some(val))).collect();
    let blocks = (COOPMAT_BLOCKS.0.to_string(), COOPMAT_BLOCKS.1.to_string());
    if v.defines.contains(&CM) {
        defines.push(("CM_TM", Some(&blocks.0)));
        defines.push(("CM_TN", Some(&blocks.1)));
    }
    let mut includes = GlslDir(glsl_dir.to_path_buf());
    let input = ShaderInput::new(
        &source,
        ShaderStage::Compute,
        &options,
        Some(&defines[..]),
        Some(&mut includes),
    )
    .unwrap_or_else(|e| panic!("shader {}: {e}", v.name));
    let shader = glslang::Shader::new(compiler, input)
        .parse()
        .unwrap_or_else(|e| panic!("shader {} ({}): {e}", v.name, v.source));
    shader
        .compile()
        .unwrap_or_else(|e| panic!("shader {} ({}): {e}", v.name, v.source))
}

fn camel(name: &str) -> String {
    // `dequant_q8_0` → `DequantQ8_0`: a part that starts with a digit keeps its underscore.
    let mut out = String::new();
    for part in name.split('_') {
        let mut c = part.chars();
        match c.next() {
            Some(f) if f.is_ascii_digit() => {
                out.push('_');
                out.push_str(part);
            }
            Some(f) => {
                out.push(f.to_ascii_uppercase());
                out.push_str(c.as_str());
            }
            None => {}
        }
    }
    out
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let glsl_dir = manifest.join("glsl");
    println!("cargo:rerun-if-changed=glsl");
    println!("cargo:rerun-if-changed=variants.rs");

    let compiler = Compiler::acquire().expect("glslang compiler");
    let mut ids = String::new();
    let mut table = String::new();
    for v in VARIANTS {
        let words = compile(compiler, &glsl_dir, v);
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let spv = out.join(format!("{}.spv", v.name));
        std::fs::write(&spv, bytes).unwrap();
        let ident = camel(v.name);
        writeln!(ids, "    {ident},").unwrap();
        writeln!(
            table,
            "    ShaderInfo {{ id: ShaderId::{ident}, name: {:?}, op: Op::{:?}, wtype: {}, feature: Feature::{:?}, spirv: include_bytes!({:?}) }},",
            v.name,
            v.op,
            match v.wtype { Some(w) => format!("Some(WeightType::{w:?})"), None => "None".into() },
            v.feature,
            spv.display().to_string(),
        )
        .unwrap();
    }
    let generated = format!(
        "/// Every compiled shader variant.\n#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]\npub enum ShaderId {{\n{ids}}}\n\n/// The variant table, in the order of `ShaderId`.\npub static SHADERS: &[ShaderInfo] = &[\n{table}];\n"
    );
    std::fs::write(out.join("shaders.rs"), generated).unwrap();
}
