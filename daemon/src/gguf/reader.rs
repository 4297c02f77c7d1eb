//! The validating GGUF reader: parses the header of a memory-mapped file into owned metadata and
//! tensor infos, and hands out tensor bytes as slices of the map.
//!
//! Every count, length and offset in the file is checked against the bytes actually present
//! before it is used, all size arithmetic is checked, and nothing is allocated from a count the
//! file claims until that count has been bounded by the bytes left. Memory used while parsing is
//! therefore proportional to the file size, whatever the header says.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapMut};

use super::error::GgufError;
use super::identity::FileIdentity;
use super::sigbus::MapGuard;
use super::types::{GgmlType, ValueType};
use super::validate::validate_architecture;
use super::value::{Array, Value};
use super::{DEFAULT_ALIGNMENT, GGUF_MAGIC};

mod metadata;

use metadata::wrong_type;
pub use metadata::Metadata;

/// Most tensors a file may declare; real models have a few thousand at most.
pub const MAX_TENSORS: u64 = 65_536;
/// Most metadata entries a file may declare; real models have a few dozen.
pub const MAX_KEYS: u64 = 8_192;
/// Longest tensor name in bytes: ggml's `GGML_MAX_NAME` (64) counts the terminating NUL, so
/// llama.cpp rejects names of 64 bytes or more and we do the same.
pub const MAX_TENSOR_NAME_LEN: usize = 63;
/// Longest metadata key in bytes. GGUF sets no limit; real keys are under 64 bytes, and 256
/// leaves room for long architecture names while keeping error messages and indexes small.
pub const MAX_KEY_LEN: usize = 256;
/// Largest `general.alignment` accepted; larger values only waste space.
pub const MAX_ALIGNMENT: u64 = 65_536;
/// Most dimensions of a tensor (`GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;

/// The smallest tensor info: an empty name (8), n_dims (4), one dim (8), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 32;

/// A parsed and validated GGUF header.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub version: u32,
    pub metadata: Metadata,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// `general.alignment`, or [`DEFAULT_ALIGNMENT`] when absent.
    pub alignment: u64,
    /// Absolute file offset of the tensor data section.
    pub data_offset: u64,
}

impl Header {
    /// The tensor called `name` (a linear search; [`GgufFile::tensor`] keeps an index).
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// `general.architecture`, when present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata.opt_str("general.architecture").ok().flatten()
    }
}

/// One tensor's description from the header. Sizes are computed and checked at parse time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub ggml_type: GgmlType,
    /// `ne[0]` (innermost, contiguous) first, as stored; 1 to 4 entries, none zero.
    pub dims: Vec<u64>,
    /// Offset of the first byte relative to the data section; a multiple of the alignment.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Size along `axis`, with ggml's convention that missing trailing axes have size 1.
    pub fn dim(&self, axis: usize) -> u64 {
        self.dims.get(axis).copied().unwrap_or(1)
    }
}

/// A model file, memory-mapped, with its header parsed and validated.
pub struct GgufFile {
    /// Catches reads past the end of a file truncated while mapped (declared before `map`, so
    /// that it is dropped before the map is unmapped); `None` for a file made from bytes.
    guard: Option<MapGuard>,
    /// The open file and what identified it at open, to tell whether it changed since.
    opened: Option<(File, FileIdentity)>,
    map: Mmap,
    header: Header,
    tensor_index: HashMap<String, usize>,
    /// `None` for a file made from bytes in memory.
    path: Option<PathBuf>,
}

impl GgufFile {
    /// Maps the file, parses its header and checks it, including the architecture consistency
    /// checks of [`validate_architecture`].
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        Self::open_with(path.as_ref(), parse_header)
    }

    /// Like [`GgufFile::open`] but without the architecture checks, for tools that inspect
    /// files a model would refuse (the structural checks, which make every accessor safe, stay).
    pub fn open_structure_only(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        Self::open_with(path.as_ref(), parse_header_structure)
    }

    fn open_with(
        path: &Path,
        parse: fn(&[u8]) -> Result<Header, GgufError>,
    ) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let seen = FileIdentity::of(&file.metadata().map_err(io)?);
        // SAFETY: the map is read-only, and nothing here writes the file. Another process may
        // still rewrite or truncate it while mapped: pages past a new end are caught by the
        // guard (see `sigbus`), and [`GgufFile::intact`] reports either change, which the
        // engine's callers check after every step so that nothing read from a changed file
        // reaches anyone.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let guard = MapGuard::new(map.as_ptr(), map.len());
        let mut f = Self::from_map(map, parse, Some(path.to_path_buf()))?;
        f.guard = Some(guard);
        f.opened = Some((file, seen));
        Ok(f)
    }

    /// `Ok` while the file is as it was when opened; otherwise what changed (truncated,
    /// rewritten, replaced, or pages of the map read past a new end and now zeros), in a
    /// message that names the file. Two `stat` calls: cheap next to a decode step.
    pub fn intact(&self) -> Result<(), String> {
        let (Some((file, seen)), Some(path)) = (&self.opened, &self.path) else {
            return Ok(());
        };
        let faulted = self.guard.as_ref().is_some_and(MapGuard::faulted);
        let what = match (seen.changed(file, path), faulted) {
            (None, false) => return Ok(()),
            (Some(w), false) => w,
            (Some(w), true) => format!("{w}; pages past its new end were read"),
            (None, true) => "pages past its end were read".to_string(),
        };
        Err(format!(
            "the model file {} changed on disk while loaded ({what}): load it again",
            path.display()
        ))
    }

    /// A file held in memory, copied into an anonymous map, with the checks of
    /// [`GgufFile::open`]: for tests and fuzzing, which have bytes rather than a path.
    pub fn from_bytes(bytes: &[u8]) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: "<memory>".into(),
            source,
        };
        let mut map = MmapMut::map_anon(bytes.len()).map_err(io)?;
        map.copy_from_slice(bytes);
        Self::from_map(map.make_read_only().map_err(io)?, parse_header, None)
    }

    fn from_map(
        map: Mmap,
        parse: fn(&[u8]) -> Result<Header, GgufError>,
        path: Option<PathBuf>,
    ) -> Result<GgufFile, GgufError> {
        let header = parse(&map)?;
        let tensor_index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            guard: None,
            opened: None,
            map,
            header,
            tensor_index,
            path,
        })
    }

    /// The path the file was opened from (`None` when made from bytes).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// `general.alignment`, or 32 when absent.
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    pub fn file_size(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn metadata(&self) -> &Metadata {
        &self.header.metadata
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.header.tensors[i])
    }

    /// The tensor's bytes inside the map. Bounds were checked at open, so for a tensor of this
    /// file this is exactly `n_bytes` long; a foreign `TensorInfo` out of range gets `&[]`.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = self.header.data_offset.checked_add(t.offset);
        let range = start.zip(start.and_then(|s| s.checked_add(t.n_bytes)));
        range
            .and_then(|(s, e)| Some(usize::try_from(s).ok()?..usize::try_from(e).ok()?))
            .and_then(|r| self.map.get(r))
            .unwrap_or(&[])
    }

    /// `general.architecture`, when present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.header.architecture()
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("file_size", &self.file_size())
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

/// Parses and fully validates a whole file held in memory: the structure, then the architecture
/// consistency checks. `bytes` must be the entire file, since tensor extents are checked
/// against its length.
pub fn parse_header(bytes: &[u8]) -> Result<Header, GgufError> {
    let header = parse_header_structure(bytes)?;
    validate_architecture(&header)?;
    Ok(header)
}

/// Parses a whole file held in memory with the structural checks only (framing, types, names,
/// sizes, alignment and extents of tensors), skipping [`validate_architecture`].
pub fn parse_header_structure(bytes: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic = c.u32(&|| "magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let tensor_count = c.u64(&|| "tensor count".into())?;
    let kv_count = c.u64(&|| "metadata entry count".into())?;
    if tensor_count > MAX_TENSORS {
        return Err(GgufError::TooManyTensors {
            count: tensor_count,
            max: MAX_TENSORS,
        });
    }
    if kv_count > MAX_KEYS {
        return Err(GgufError::TooManyKeys {
            count: kv_count,
            max: MAX_KEYS,
        });
    }

    let mut metadata = Metadata::new();
    for i in 0..kv_count {
        let what = || format!("key of metadata entry {i}");
        let raw = c.string(&what)?;
        if raw.len() > MAX_KEY_LEN {
            let key = String::from_utf8_lossy(&raw[..MAX_KEY_LEN]).into_owned();
            return Err(GgufError::KeyTooLong {
                key,
                len: raw.len(),
                max: MAX_KEY_LEN,
            });
        }
        let key = utf8(raw, &what)?;
        if metadata.contains_key(key) {
            return Err(GgufError::DuplicateKey {
                key: key.to_owned(),
            });
        }
        let type_id = c.u32(&|| format!("value type of {key}"))?;
        let value = read_value(&mut c, key, type_id)?;
        metadata.insert(key, value)?;
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(&Value::U32(a)) => {
            let a = u64::from(a);
            if !a.is_power_of_two() || a > MAX_ALIGNMENT {
                return Err(GgufError::InvalidAlignment {
                    value: a,
                    max: MAX_ALIGNMENT,
                });
            }
            a
        }
        Some(other) => return Err(wrong_type("general.alignment", "u32", other)),
    };

    // Capacity bounded by what the remaining bytes can describe, not by the claimed count.
    let fit = (c.remaining() / MIN_TENSOR_INFO_BYTES).min(tensor_count);
    let mut tensors = Vec::with_capacity(fit as usize);
    let mut names = HashSet::new();
    for i in 0..tensor_count {
        let t = read_tensor_info(&mut c, i, alignment)?;
        if !names.insert(t.name.clone()) {
            return Err(GgufError::DuplicateTensor { name: t.name });
        }
        tensors.push(t);
    }

    let data_offset = (c.pos as u64).next_multiple_of(alignment);
    check_extents(&tensors, data_offset, bytes.len() as u64)?;
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

fn read_value(c: &mut Cursor<'_>, key: &str, type_id: u32) -> Result<Value, GgufError> {
    let unknown = |type_id| GgufError::UnknownValueType {
        key: key.to_owned(),
        type_id,
    };
    let ty = ValueType::from_u32(type_id).ok_or_else(|| unknown(type_id))?;
    let what = || format!("value of {key}");
    Ok(match ty {
        ValueType::U8 => Value::U8(c.u8(&what)?),
        ValueType::I8 => Value::I8(i8::from_le_bytes(c.le(&what)?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.le(&what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.le(&what)?)),
        ValueType::U32 => Value::U32(c.u32(&what)?),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.le(&what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.le(&what)?)),
        ValueType::Bool => Value::Bool(to_bool_byte(c.u8(&what)?, &what)?),
        ValueType::String => Value::String(utf8(c.string(&what)?, &what)?.to_owned()),
        ValueType::U64 => Value::U64(c.u64(&what)?),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.le(&what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.le(&what)?)),
        ValueType::Array => {
            let elem_id = c.u32(&|| format!("element type of {key}"))?;
            let elem = ValueType::from_u32(elem_id).ok_or_else(|| unknown(elem_id))?;
            if elem == ValueType::Array {
                return Err(GgufError::NestedArray {
                    key: key.to_owned(),
                });
            }
            let count = c.u64(&|| format!("element count of {key}"))?;
            // A string element takes at least its 8-byte length prefix.
            let min_bytes = elem.scalar_size().unwrap_or(8) as u64;
            if count
                .checked_mul(min_bytes)
                .is_none_or(|n| n > c.remaining())
            {
                return Err(GgufError::ArrayPastEnd {
                    key: key.to_owned(),
                    count,
                    elem_type: elem,
                    available: c.remaining(),
                });
            }
            Value::Array(read_array(c, key, elem, count as usize)?)
        }
    })
}

/// Reads `n` elements of `elem`; the caller has checked that `n` minimal elements fit in the
/// bytes left, so every allocation here is bounded by the file size.
fn read_array(
    c: &mut Cursor<'_>,
    key: &str,
    elem: ValueType,
    n: usize,
) -> Result<Array, GgufError> {
    let what = || format!("elements of {key}");
    macro_rules! numeric {
        ($variant:ident, $t:ty) => {{
            const SIZE: usize = std::mem::size_of::<$t>();
            let bytes = c.take(n * SIZE, &what)?;
            Array::$variant(
                bytes
                    .chunks_exact(SIZE)
                    .map(|b| <$t>::from_le_bytes(le(b)))
                    .collect(),
            )
        }};
    }
    Ok(match elem {
        ValueType::U8 => Array::U8(c.take(n, &what)?.to_vec()),
        ValueType::I8 => numeric!(I8, i8),
        ValueType::U16 => numeric!(U16, u16),
        ValueType::I16 => numeric!(I16, i16),
        ValueType::U32 => numeric!(U32, u32),
        ValueType::I32 => numeric!(I32, i32),
        ValueType::F32 => numeric!(F32, f32),
        ValueType::U64 => numeric!(U64, u64),
        ValueType::I64 => numeric!(I64, i64),
        ValueType::F64 => numeric!(F64, f64),
        ValueType::Bool => Array::Bool(
            c.take(n, &what)?
                .iter()
                .map(|&b| to_bool_byte(b, &what))
                .collect::<Result<_, _>>()?,
        ),
        ValueType::String => {
            let mut strings = Vec::with_capacity(n);
            for j in 0..n {
                let what = || format!("element {j} of {key}");
                strings.push(utf8(c.string(&what)?, &what)?.to_owned());
            }
            Array::String(strings)
        }
        ValueType::Array => {
            return Err(GgufError::NestedArray {
                key: key.to_owned(),
            })
        }
    })
}

fn read_tensor_info(
    c: &mut Cursor<'_>,
    index: u64,
    alignment: u64,
) -> Result<TensorInfo, GgufError> {
    let what = || format!("name of tensor {index}");
    let raw = c.string(&what)?;
    if raw.len() > MAX_TENSOR_NAME_LEN {
        let name = String::from_utf8_lossy(&raw[..MAX_TENSOR_NAME_LEN]).into_owned();
        let (len, max) = (raw.len(), MAX_TENSOR_NAME_LEN);
        return Err(GgufError::TensorNameTooLong { name, len, max });
    }
    let name = utf8(raw, &what)?.to_owned();

    let n_dims = c.u32(&|| format!("n_dims of tensor {name}"))?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(GgufError::BadDimensionCount {
            tensor: name,
            n_dims,
            max: MAX_DIMS,
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for axis in 0..n_dims as usize {
        let d = c.u64(&|| format!("dimension {axis} of tensor {name}"))?;
        if d == 0 {
            return Err(GgufError::ZeroDimension { tensor: name, axis });
        }
        dims.push(d);
    }
    let type_id = c.u32(&|| format!("type of tensor {name}"))?;
    let offset = c.u64(&|| format!("offset of tensor {name}"))?;
    let Some(ggml_type) = GgmlType::from_u32(type_id) else {
        return Err(GgufError::UnknownTensorType {
            tensor: name,
            type_id,
        });
    };

    let overflow = |what| GgufError::SizeOverflow {
        tensor: name.clone(),
        what,
    };
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| overflow("element count"))?;
    let (ne0, block_size) = (dims[0], ggml_type.block_size());
    if !ne0.is_multiple_of(block_size) {
        return Err(GgufError::NotWholeBlocks {
            tensor: name,
            ggml_type,
            ne0,
            block_size,
        });
    }
    let n_bytes = ggml_type
        .row_bytes(ne0)
        .and_then(|row| dims[1..].iter().try_fold(row, |acc, &d| acc.checked_mul(d)))
        .ok_or_else(|| overflow("byte size"))?;
    if !offset.is_multiple_of(alignment) {
        return Err(GgufError::MisalignedTensor {
            tensor: name,
            offset,
            alignment,
        });
    }
    Ok(TensorInfo {
        name,
        ggml_type,
        dims,
        offset,
        n_elements,
        n_bytes,
    })
}

/// Every tensor must lie inside the file and no two may share a byte.
fn check_extents(
    tensors: &[TensorInfo],
    data_offset: u64,
    file_size: u64,
) -> Result<(), GgufError> {
    for t in tensors {
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.n_bytes))
            .ok_or_else(|| GgufError::SizeOverflow {
                tensor: t.name.clone(),
                what: "end offset",
            })?;
        if end > file_size {
            return Err(GgufError::TensorPastEnd {
                tensor: t.name.clone(),
                end,
                file_size,
            });
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        // Both ends fit in u64: they were bounded by the file size above.
        if pair[1].offset < pair[0].offset + pair[0].n_bytes {
            return Err(GgufError::OverlappingTensors {
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
            });
        }
    }
    Ok(())
}

fn utf8<'a>(raw: &'a [u8], what: &dyn Fn() -> String) -> Result<&'a str, GgufError> {
    std::str::from_utf8(raw).map_err(|_| GgufError::InvalidUtf8 { what: what() })
}

fn to_bool_byte(b: u8, what: &dyn Fn() -> String) -> Result<bool, GgufError> {
    match b {
        0 => Ok(false),
        1 => Ok(true),
        byte => Err(GgufError::InvalidBool { what: what(), byte }),
    }
}

/// Copies a slice whose length the caller guarantees into an array.
fn le<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(b);
    a
}

/// A bounds-checked little-endian reader. `what` closures name the field for error messages and
/// only run on failure, so the happy path does not format strings.
struct Cursor<'a> {
    bytes: &'a [u8],
    /// Invariant: `pos <= bytes.len()`.
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let rest = &self.bytes[self.pos..];
        if n > rest.len() {
            return Err(GgufError::UnexpectedEof {
                what: what(),
                offset: self.pos as u64,
                needed: n as u64,
                available: rest.len() as u64,
            });
        }
        self.pos += n;
        Ok(&rest[..n])
    }

    fn le<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        self.take(N, what).map(le)
    }

    fn u8(&mut self, what: &dyn Fn() -> String) -> Result<u8, GgufError> {
        Ok(self.le::<1>(what)?[0])
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        self.le(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        self.le(what).map(u64::from_le_bytes)
    }

    /// A GGUF string: u64 length, then that many bytes, the length checked before use.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let len = self.u64(&|| format!("length of {}", what()))?;
        if len > self.remaining() {
            return Err(GgufError::StringPastEnd {
                what: what(),
                offset: self.pos as u64,
                len,
                available: self.remaining(),
            });
        }
        self.take(len as usize, what)
    }
}

#[cfg(test)]
mod tests;
