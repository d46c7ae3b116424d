//! Reading the `state_dict` files that Python's `torch.save` writes (`.pth`, `.pt`), such as
//! torchvision's published ImageNet weights, without Python.
//!
//! `torch.save` has written two layouts, both read here:
//! - since PyTorch 1.6, a zip archive: `<name>/data.pkl` (the pickled object) and one entry
//!   `<name>/data/<key>` per storage, raw elements;
//! - before, the legacy layout that torchvision's older weights still have (`vgg19-dcbb9e9d.pth`
//!   is from 2017): five pickles one after the other (a magic number, the protocol version, the
//!   writer's byte order and type sizes, the object, the list of storage keys), then each
//!   storage's element count (8 bytes, little-endian) and raw elements, in the keys' order.
//!
//! Both pickle the `state_dict` the same way: an `OrderedDict` whose tensors are rebuilt by
//! `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` over storages named by
//! persistent ids `('storage', torch.FloatStorage, key, location, numel)`, and whose `_metadata`
//! (the modules' versions) is set by BUILD. This module runs the small part of the pickle
//! machine that uses. LibTorch does not do it: its `torch::pickle_load` (C++) reads only the zip
//! layout, and fails there on the `_metadata` every `state_dict()` carries ("Expected
//! GenericDict but got None", PyTorch 2.11), so it cannot read torchvision's files.
//!
//! A file that holds anything else (a whole pickled model, an optimizer, a checkpoint dict
//! nesting the weights under a key) is refused in one line that says what it holds.
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::path::Path;
use tch::{Kind, Tensor};

/// The first bytes of a zip archive (the layout since PyTorch 1.6).
const ZIP_MAGIC: &[u8] = b"PK\x03\x04";
/// The legacy layout's magic number, its first pickle (80 bits: read as a big integer).
const LEGACY_MAGIC: i128 = 0x1950a86a20f9469cfc6c;
/// The legacy layout's protocol version, its second pickle.
const LEGACY_PROTOCOL: i64 = 1001;

/// The named tensors of a `state_dict` that `torch.save` wrote, on the CPU, in the file's order.
pub fn read_state_dict(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let bytes = crate::input::read(path, u64::MAX, "give the file torch.save wrote")?;
    if bytes.starts_with(ZIP_MAGIC) {
        return zip_layout(&bytes).map_err(|e| anyhow!("{} is not a state_dict torch.save wrote: {e:#}", path.display()));
    }
    if bytes.first() == Some(&0x80) {
        return legacy(&bytes).map_err(|e| anyhow!("{} is not a state_dict torch.save wrote (legacy layout): {e:#}", path.display()));
    }
    bail!("{} is not a file torch.save wrote (neither its zip layout nor its legacy pickles)", path.display())
}

/// A zip-layout file's tensors.
fn zip_layout(bytes: &[u8]) -> Result<Vec<(String, Tensor)>> {
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(bytes)).context("a torn or damaged zip archive")?;
    let pickle_name = archive
        .file_names()
        .find(|n| *n == "data.pkl" || n.ends_with("/data.pkl"))
        .map(String::from)
        .ok_or_else(|| anyhow!("a zip archive without data.pkl"))?;
    let prefix = pickle_name.strip_suffix("data.pkl").expect("found by that ending").to_string();
    let pickle = read_entry(&mut archive, &pickle_name)?;
    let object = Unpickler::new(&pickle, &mut 0).run()?;
    let mut kinds: HashMap<String, Kind> = HashMap::new();
    collect_storage_kinds(&object, &mut kinds)?;
    let mut storages = HashMap::new();
    for (key, kind) in kinds {
        let data = read_entry(&mut archive, &format!("{prefix}data/{key}"))?;
        if data.len() % kind.elt_size_in_bytes() != 0 {
            bail!("storage {key} holds {} bytes, not whole {kind:?} elements", data.len());
        }
        let count = (data.len() / kind.elt_size_in_bytes()) as i64;
        storages.insert(key, Tensor::from_data_size(&data, &[count], kind));
    }
    state_dict(object, &storages)
}

fn read_entry(archive: &mut zip::ZipArchive<std::io::Cursor<&[u8]>>, name: &str) -> Result<Vec<u8>> {
    let mut entry = archive.by_name(name).with_context(|| format!("no {name} in the archive"))?;
    let mut data = Vec::with_capacity(entry.size() as usize);
    std::io::Read::read_to_end(&mut entry, &mut data).with_context(|| format!("cannot read {name} (torn?)"))?;
    Ok(data)
}

/// The named tensors of `object`, a dictionary of tensors over `storages`.
fn state_dict(object: Value, storages: &HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>> {
    let Value::Dict(items) = object else { bail!("it holds a {}, not a dictionary of tensors (a state_dict)", object.what()) };
    items
        .into_iter()
        .map(|(name, value)| {
            let name = name.string()?;
            let tensor = rebuild(&value, storages).with_context(|| format!("its entry {name}"))?;
            Ok((name, tensor))
        })
        .collect()
}

/// A legacy-layout file's tensors.
fn legacy(bytes: &[u8]) -> Result<Vec<(String, Tensor)>> {
    let mut at = 0;
    let magic = Unpickler::new(bytes, &mut at).run()?;
    if !matches!(magic, Value::BigInt(n) if n == LEGACY_MAGIC) {
        bail!("no torch.save magic number at its start");
    }
    if !matches!(Unpickler::new(bytes, &mut at).run()?, Value::Int(LEGACY_PROTOCOL)) {
        bail!("an unknown torch.save protocol version");
    }
    let sys_info = Unpickler::new(bytes, &mut at).run()?;
    if let Value::Dict(items) = &sys_info {
        if items.iter().any(|(k, v)| matches!(k, Value::Str(s) if s == "little_endian") && matches!(v, Value::Bool(false))) {
            bail!("written on a big-endian machine");
        }
    }
    let object = Unpickler::new(bytes, &mut at).run()?;
    let keys = match Unpickler::new(bytes, &mut at).run()? {
        Value::List(keys) => keys.into_iter().map(|k| k.string()).collect::<Result<Vec<String>>>()?,
        other => bail!("its storage list is a {}", other.what()),
    };
    // The storages, in the keys' order: element count, then the elements.
    let mut storages: HashMap<String, Tensor> = HashMap::new();
    let mut kinds: HashMap<String, Kind> = HashMap::new();
    collect_storage_kinds(&object, &mut kinds)?;
    for key in keys {
        let kind = *kinds.get(&key).ok_or_else(|| anyhow!("storage {key} is listed but no tensor uses it"))?;
        let count = bytes.get(at..at + 8).ok_or_else(|| anyhow!("truncated: storage {key} is missing"))?;
        let count = u64::from_le_bytes(count.try_into().expect("8 bytes")) as usize;
        at += 8;
        let size = count.checked_mul(kind.elt_size_in_bytes()).ok_or_else(|| anyhow!("storage {key} claims {count} elements"))?;
        let data = bytes.get(at..at + size).ok_or_else(|| anyhow!("truncated: storage {key} has fewer than its {count} elements"))?;
        at += size;
        storages.insert(key, Tensor::from_data_size(data, &[count as i64], kind));
    }
    state_dict(object, &storages)
}

/// The storage kind of every persistent id in `value` (a storage's key → its element kind).
fn collect_storage_kinds(value: &Value, kinds: &mut HashMap<String, Kind>) -> Result<()> {
    match value {
        Value::Persistent(id) => {
            let (key, kind, _) = storage_id(id)?;
            kinds.insert(key, kind);
        }
        Value::Dict(items) => {
            for (k, v) in items {
                collect_storage_kinds(k, kinds)?;
                collect_storage_kinds(v, kinds)?;
            }
        }
        Value::Tuple(items) | Value::List(items) => items.iter().try_for_each(|v| collect_storage_kinds(v, kinds))?,
        Value::Call(callable, args) => {
            collect_storage_kinds(callable, kinds)?;
            collect_storage_kinds(args, kinds)?;
        }
        _ => {}
    }
    Ok(())
}

/// `('storage', torch.FloatStorage, key, location, numel)`: the key, element kind and location.
fn storage_id(id: &Value) -> Result<(String, Kind, String)> {
    let Value::Tuple(parts) = id else { bail!("a persistent id that is not a storage") };
    match parts.as_slice() {
        [Value::Str(tag), Value::Global(module, class), key, location, ..] if tag == "storage" && module == "torch" => {
            Ok((key.string()?, storage_kind(class)?, location.string()?))
        }
        _ => bail!("a persistent id that is not a storage"),
    }
}

fn storage_kind(class: &str) -> Result<Kind> {
    Ok(match class {
        "FloatStorage" => Kind::Float,
        "DoubleStorage" => Kind::Double,
        "HalfStorage" => Kind::Half,
        "BFloat16Storage" => Kind::BFloat16,
        "LongStorage" => Kind::Int64,
        "IntStorage" => Kind::Int,
        "ShortStorage" => Kind::Int16,
        "CharStorage" => Kind::Int8,
        "ByteStorage" => Kind::Uint8,
        "BoolStorage" => Kind::Bool,
        other => bail!("storages of torch.{other} are not read"),
    })
}

/// A tensor from `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`.
fn rebuild(value: &Value, storages: &HashMap<String, Tensor>) -> Result<Tensor> {
    let Value::Call(callable, args) = value else { bail!("is a {}, not a tensor", value.what()) };
    match (callable.as_ref(), args.as_ref()) {
        (Value::Global(module, name), Value::Tuple(args)) if module == "torch._utils" && (name == "_rebuild_tensor_v2" || name == "_rebuild_tensor") => {
            let [Value::Persistent(id), offset, size, stride, ..] = args.as_slice() else { bail!("a tensor without its storage") };
            let (key, _, _) = storage_id(id)?;
            let storage = storages.get(&key).ok_or_else(|| anyhow!("its storage {key} is missing from the file"))?;
            let (offset, size, stride) = (offset.int()?, size.ints()?, stride.ints()?);
            let numel = storage.size()[0];
            // The furthest element the view reaches must lie in the storage.
            let last = offset + size.iter().zip(&stride).map(|(n, s)| (n - 1).max(0) * s).sum::<i64>();
            if size.len() != stride.len() || size.iter().chain(&stride).any(|&n| n < 0) || (size.iter().all(|&n| n > 0) && last >= numel) {
                bail!("its view (offset {offset}, size {size:?}, stride {stride:?}) lies outside its storage of {numel} elements");
            }
            Ok(storage.as_strided(&size, &stride, Some(offset)).contiguous())
        }
        (Value::Global(module, name), _) => bail!("is built by {module}.{name}, not a tensor"),
        _ => bail!("is not a tensor"),
    }
}

/// A pickled value, as far as a `state_dict` needs.
#[derive(Debug, Clone)]
enum Value {
    None,
    Bool(bool),
    Int(i64),
    BigInt(i128),
    /// A float (its value is never needed here).
    Float,
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// A class or function named by GLOBAL: module and name.
    Global(String, String),
    /// A call (REDUCE) not evaluated: the callable and its argument tuple.
    Call(Box<Value>, Box<Value>),
    Persistent(Box<Value>),
    Mark,
}

impl Value {
    fn what(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::Tuple(_) => "tuple",
            Value::List(_) => "list",
            Value::Dict(_) => "dictionary",
            Value::Global(..) => "class",
            Value::Call(..) => "object",
            Value::Persistent(_) => "storage",
            Value::Mark => "mark",
        }
    }
    fn string(&self) -> Result<String> {
        match self {
            Value::Str(s) => Ok(s.clone()),
            Value::Bytes(b) => Ok(String::from_utf8_lossy(b).into_owned()),
            other => bail!("a {} where a name belongs", other.what()),
        }
    }
    fn int(&self) -> Result<i64> {
        match self {
            Value::Int(n) => Ok(*n),
            other => bail!("a {} where an integer belongs", other.what()),
        }
    }
    fn ints(&self) -> Result<Vec<i64>> {
        match self {
            Value::Tuple(items) | Value::List(items) => items.iter().map(Value::int).collect(),
            other => bail!("a {} where a shape belongs", other.what()),
        }
    }
}

/// One pickle, read from `bytes` at `*at` up to its STOP, which `*at` is then past.
struct Unpickler<'a> {
    bytes: &'a [u8],
    at: &'a mut usize,
    stack: Vec<Value>,
    memo: HashMap<u32, Value>,
}

impl<'a> Unpickler<'a> {
    fn new(bytes: &'a [u8], at: &'a mut usize) -> Self {
        Self { bytes, at, stack: Vec::new(), memo: HashMap::new() }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let start = *self.at;
        let slice = self.bytes.get(start..start.checked_add(n).ok_or_else(|| anyhow!("a length past the file"))?).ok_or_else(|| anyhow!("truncated"))?;
        *self.at += n;
        Ok(slice)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn line(&mut self) -> Result<String> {
        let rest = &self.bytes[*self.at..];
        let end = rest.iter().position(|&b| b == b'\n').ok_or_else(|| anyhow!("truncated"))?;
        let text = String::from_utf8_lossy(&rest[..end]).into_owned();
        *self.at += end + 1;
        Ok(text)
    }
    fn pop(&mut self) -> Result<Value> {
        self.stack.pop().ok_or_else(|| anyhow!("a malformed pickle (its stack ran empty)"))
    }
    fn top(&mut self) -> Result<&mut Value> {
        self.stack.last_mut().ok_or_else(|| anyhow!("a malformed pickle (its stack ran empty)"))
    }
    /// The values above the topmost MARK, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Value>> {
        let mark = self.stack.iter().rposition(|v| matches!(v, Value::Mark)).ok_or_else(|| anyhow!("a malformed pickle (no MARK)"))?;
        let items = self.stack.split_off(mark + 1);
        self.stack.pop();
        Ok(items)
    }
    fn memo_get(&mut self, key: u32) -> Result<()> {
        let value = self.memo.get(&key).cloned().ok_or_else(|| anyhow!("a malformed pickle (memo {key} unset)"))?;
        self.stack.push(value);
        Ok(())
    }
    fn memo_put(&mut self, key: u32) -> Result<()> {
        let value = self.top()?.clone();
        self.memo.insert(key, value);
        Ok(())
    }
    fn set_items(&mut self, pairs: Vec<Value>) -> Result<()> {
        if !pairs.len().is_multiple_of(2) {
            bail!("a malformed pickle (a key without a value)");
        }
        let target = self.top()?;
        let items = match target {
            Value::Dict(items) => items,
            // collections.OrderedDict() (a state_dict): a dictionary like any other here.
            Value::Call(callable, _) if matches!(callable.as_ref(), Value::Global(m, n) if m == "collections" && n == "OrderedDict") => {
                *target = Value::Dict(Vec::new());
                let Value::Dict(items) = target else { unreachable!() };
                items
            }
            other => bail!("items set on a {}", other.what()),
        };
        let mut pairs = pairs.into_iter();
        while let (Some(k), Some(v)) = (pairs.next(), pairs.next()) {
            items.push((k, v));
        }
        Ok(())
    }

    fn run(mut self) -> Result<Value> {
        loop {
            match self.u8()? {
                b'.' => return self.pop(), // STOP: the pickled object is on the stack
                0x80 => {
                    self.u8()?; // PROTO n
                }
                0x95 => {
                    self.take(8)?; // FRAME length
                }
                op @ (b'N' | 0x88 | 0x89 | b'J' | b'K' | b'M' | 0x8a | b'G') => self.push_scalar(op)?,
                op @ (b'X' | 0x8c | b'T' | b'U') => self.push_text(op)?,
                op @ (b'}' | b']' | b')' | b'(' | b't' | 0x85..=0x87 | b's' | b'u' | b'a' | b'e') => self.build_container(op)?,
                op @ (b'q' | b'r' | 0x94 | b'h' | b'j') => self.memo_op(op)?,
                op @ (b'c' | 0x93 | b'Q' | b'R' | 0x81 | b'b') => self.object_op(op)?,
                other => bail!("pickle opcode 0x{other:02x} is not one a state_dict uses"),
            }
        }
    }

    /// None, booleans, integers, floats (whose value a state_dict does not need).
    fn push_scalar(&mut self, op: u8) -> Result<()> {
        let value = match op {
            b'N' => Value::None,
            0x88 => Value::Bool(true),
            0x89 => Value::Bool(false),
            b'J' => Value::Int(i32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as i64),
            b'K' => Value::Int(self.u8()? as i64),
            b'M' => Value::Int(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as i64),
            0x8a => {
                // LONG1: n bytes of a little-endian two's-complement integer.
                let n = self.u8()? as usize;
                if n > 16 {
                    bail!("an integer of {n} bytes");
                }
                let digits = self.take(n)?;
                let mut value: i128 = 0;
                for (i, &b) in digits.iter().enumerate() {
                    value |= (b as i128) << (8 * i);
                }
                if n > 0 && n < 16 && digits[n - 1] & 0x80 != 0 {
                    value -= 1i128 << (8 * n);
                }
                i64::try_from(value).map(Value::Int).unwrap_or(Value::BigInt(value))
            }
            b'G' => {
                self.take(8)?;
                Value::Float
            }
            _ => unreachable!("0x{op:02x} is no scalar's opcode"),
        };
        self.stack.push(value);
        Ok(())
    }

    /// Strings (4-byte or 1-byte length) and bytes likewise.
    fn push_text(&mut self, op: u8) -> Result<()> {
        let n = match op {
            b'X' | b'T' => self.u32()? as usize,
            _ => self.u8()? as usize,
        };
        let value = match op {
            b'X' | 0x8c => Value::Str(String::from_utf8_lossy(self.take(n)?).into_owned()),
            b'T' | b'U' => Value::Bytes(self.take(n)?.to_vec()),
            _ => unreachable!("0x{op:02x} is no string's opcode"),
        };
        self.stack.push(value);
        Ok(())
    }

    /// Empty dicts, lists and tuples, the mark, tuples of what is above it or of the top
    /// 1 to 3 items, and items set in a dict or appended to a list.
    fn build_container(&mut self, op: u8) -> Result<()> {
        match op {
            b'}' => self.stack.push(Value::Dict(Vec::new())),
            b']' => self.stack.push(Value::List(Vec::new())),
            b')' => self.stack.push(Value::Tuple(Vec::new())),
            b'(' => self.stack.push(Value::Mark),
            b't' => {
                let items = self.pop_mark()?;
                self.stack.push(Value::Tuple(items));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                if self.stack.len() < n {
                    bail!("a malformed pickle (a tuple of missing items)");
                }
                let items = self.stack.split_off(self.stack.len() - n);
                self.stack.push(Value::Tuple(items));
            }
            b's' => {
                let value = self.pop()?;
                let key = self.pop()?;
                self.set_items(vec![key, value])?;
            }
            b'u' => {
                let pairs = self.pop_mark()?;
                self.set_items(pairs)?;
            }
            b'a' => {
                let value = self.pop()?;
                match self.top()? {
                    Value::List(items) => items.push(value),
                    other => bail!("an item appended to a {}", other.what()),
                }
            }
            b'e' => {
                let values = self.pop_mark()?;
                match self.top()? {
                    Value::List(items) => items.extend(values),
                    other => bail!("items appended to a {}", other.what()),
                }
            }
            _ => unreachable!("0x{op:02x} is no container's opcode"),
        }
        Ok(())
    }

    /// The memo: the top of the stack put under a key (given, or the next), or a value got back.
    fn memo_op(&mut self, op: u8) -> Result<()> {
        match op {
            b'q' => {
                let key = self.u8()? as u32;
                self.memo_put(key)
            }
            b'r' => {
                let key = self.u32()?;
                self.memo_put(key)
            }
            0x94 => self.memo_put(self.memo.len() as u32),
            b'h' => {
                let key = self.u8()? as u32;
                self.memo_get(key)
            }
            b'j' => {
                let key = self.u32()?;
                self.memo_get(key)
            }
            _ => unreachable!("0x{op:02x} is no memo's opcode"),
        }
    }

    /// Globals (a module's name), persistent ids (a tensor's storage), calls (a tensor rebuilt,
    /// an OrderedDict) and an object's state, which is left aside.
    fn object_op(&mut self, op: u8) -> Result<()> {
        match op {
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.stack.push(Value::Global(module, name));
            }
            0x93 => {
                // STACK_GLOBAL
                let name = self.pop()?.string()?;
                let module = self.pop()?.string()?;
                self.stack.push(Value::Global(module, name));
            }
            b'Q' => {
                let id = self.pop()?;
                self.stack.push(Value::Persistent(Box::new(id)));
            }
            b'R' | 0x81 => {
                let args = self.pop()?;
                let callable = self.pop()?;
                self.stack.push(Value::Call(Box::new(callable), Box::new(args)));
            }
            b'b' => {
                // BUILD: an object's state (a tensor's, a module's): kept aside, not needed.
                self.pop()?;
            }
            _ => unreachable!("0x{op:02x} is no object's opcode"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-written legacy file: one 2×3 float tensor `w` viewed from offset 1 of a storage of
    /// 7 elements, with stride (3, 1), in an OrderedDict; its storage data after the pickles.
    fn legacy_file(elements: &[f32], keys: &[&str]) -> Vec<u8> {
        let mut b = Vec::new();
        // magic: LONG1 10 bytes
        b.extend([0x80, 2, 0x8a, 10]);
        b.extend(&0x1950a86a20f9469cfc6c_i128.to_le_bytes()[..10]);
        b.push(b'.');
        b.extend([0x80, 2, b'M']);
        b.extend(1001u16.to_le_bytes());
        b.push(b'.');
        b.extend([0x80, 2, b'}', b'.']);
        // the object
        b.extend([0x80, 2]);
        b.extend(b"ccollections\nOrderedDict\n)R(");
        b.extend([b'X', 1, 0, 0, 0, b'w']);
        b.extend(b"ctorch._utils\n_rebuild_tensor_v2\n((");
        b.extend([b'X', 7, 0, 0, 0]);
        b.extend(b"storage");
        b.extend(b"ctorch\nFloatStorage\n");
        b.extend([b'X', 1, 0, 0, 0, b'0', b'X', 3, 0, 0, 0]);
        b.extend(b"cpu");
        b.extend([b'K', 7, b't', b'Q', b'K', 1, b'K', 2, b'K', 3, 0x86, b'K', 3, b'K', 1, 0x86, 0x89]);
        b.extend(b"ccollections\nOrderedDict\n)Rtq\x00R");
        b.extend(b"u.");
        // the storage keys
        b.extend([0x80, 2, b']', b'(']);
        for k in keys {
            b.extend([b'X', k.len() as u8, 0, 0, 0]);
            b.extend(k.as_bytes());
        }
        b.extend(b"e.");
        b.extend((elements.len() as u64).to_le_bytes());
        for e in elements {
            b.extend(e.to_le_bytes());
        }
        b
    }

    #[test]
    fn a_legacy_state_dict_is_read_with_its_views() {
        let elements: Vec<f32> = (0..7).map(|i| i as f32).collect();
        let named = legacy(&legacy_file(&elements, &["0"])).unwrap();
        assert_eq!(named.len(), 1);
        assert_eq!(named[0].0, "w");
        assert_eq!(named[0].1.size(), [2, 3]);
        assert_eq!(Vec::<f32>::try_from(named[0].1.flatten(0, -1)).unwrap(), [1., 2., 3., 4., 5., 6.]);
    }

    #[test]
    fn truncated_or_inconsistent_legacy_files_are_refused() {
        let elements: Vec<f32> = (0..7).map(|i| i as f32).collect();
        let whole = legacy_file(&elements, &["0"]);
        let cut = legacy(&whole[..whole.len() - 3]).unwrap_err().to_string();
        assert!(cut.contains("truncated"), "{cut}");
        let small = legacy(&legacy_file(&elements[..5], &["0"])).unwrap_err();
        assert!(format!("{small:#}").contains("outside its storage"), "{small:#}");
        let unused = legacy(&legacy_file(&elements, &["1"])).unwrap_err().to_string();
        assert!(unused.contains("no tensor uses it"), "{unused}");
        let mut not_magic = whole.clone();
        not_magic[4] ^= 1;
        assert!(legacy(&not_magic).unwrap_err().to_string().contains("magic"));
    }
}
