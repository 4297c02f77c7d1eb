//! Keeps a chat template from building a namespace that contains itself.
//!
//! `namespace()` objects are the one mutable value Jinja gives a template, and minijinja stores
//! whatever `{% set ns.attr = value %}` assigns. `{% set ns.me = ns %}` (or `[ns]`, or a map
//! holding it) makes a cycle, and printing, comparing or serialising the namespace then
//! recurses without end: no stack is deep enough, and the process aborts. A model file's
//! template must not be able to do that to the daemon.
//!
//! [`guard_assignments`] rewrites the template so that every value assigned to an attribute
//! passes through the [`FILTER`] filter, which [`NamespaceGuard`] implements: a value may hold
//! none, booleans, numbers, strings, bytes, lists and maps of those, and nothing else (no
//! namespace, macro, loop object or lazy sequence inside it; a lazy sequence assigned whole
//! is stored as a list). Since every value stored in a namespace
//! obeys that, no namespace can reach itself. Real templates store flags, counters, indices
//! and strings there.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use minijinja::machinery::{tokenize, Token};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};
use parking_lot::Mutex;

/// Name of the filter every namespace assignment is routed through.
pub const FILTER: &str = "__spillway_plain_value";

/// Values the filter may visit in one rendering: far above what real templates assign (each
/// list or map is visited once, later assignments that reuse it cost one step), low enough
/// that a template growing a list element by element cannot make the checks quadratic.
const VISIT_BUDGET: u64 = 2_000_000;

/// `source` with the value of every `{% set a.b = value %}` (and the filter chain of every
/// `{% set a.b | filters %}…{% endset %}`) passed through [`FILTER`]. Statements that assign
/// plain names are left alone. `None` when the source does not lex (it will not compile
/// either).
pub fn guard_assignments(source: &str, syntax: SyntaxConfig) -> Option<String> {
    let tokens: Vec<_> = tokenize(source, false, syntax)
        .collect::<Result<_, _>>()
        .ok()?;
    let (open, close, chained) = (" (", format!(")|{FILTER} "), format!("|{FILTER} "));
    // (byte offset, text) insertions, in source order.
    let mut inserts: Vec<(usize, &str)> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let starts_set = matches!(tokens[i].0, Token::BlockStart)
            && matches!(tokens.get(i + 1), Some((Token::Ident("set"), _)));
        if !starts_set {
            i += 1;
            continue;
        }
        // The target runs to the first `=`, `|` or `%}` outside parentheses.
        let mut j = i + 2;
        let mut depth = 0usize;
        let mut dotted = false;
        while let Some((tok, _)) = tokens.get(j) {
            match tok {
                Token::ParenOpen => depth += 1,
                Token::ParenClose => depth = depth.saturating_sub(1),
                Token::Dot => dotted = true,
                Token::Assign | Token::Pipe | Token::BlockEnd if depth == 0 => break,
                _ => {}
            }
            j += 1;
        }
        let Some((op, op_span)) = tokens.get(j) else {
            break;
        };
        let end = tokens[j..]
            .iter()
            .position(|(t, _)| matches!(t, Token::BlockEnd))
            .map(|k| j + k);
        if let (true, Some(end)) = (dotted, end) {
            let at_end = tokens[end].1.start_offset as usize;
            match op {
                Token::Assign => {
                    inserts.push((op_span.end_offset as usize, open));
                    inserts.push((at_end, &close));
                }
                // The captured text, then the statement's filters, then the check.
                Token::Pipe => inserts.push((at_end, &chained)),
                // A block without filters assigns the captured text: a string.
                _ => {}
            }
        }
        i = end.map_or(tokens.len(), |e| e + 1);
    }
    let mut out = String::with_capacity(source.len() + inserts.len() * close.len());
    let mut from = 0;
    for (at, text) in inserts {
        out.push_str(&source[from..at]);
        out.push_str(text);
        from = at;
    }
    out.push_str(&source[from..]);
    Some(out)
}

/// The state of [`FILTER`] over one rendering: lists and maps already found plain (kept
/// alive, so that their addresses stay theirs), and the visits left.
pub struct NamespaceGuard {
    plain: HashMap<usize, Value>,
    visits_left: u64,
}

impl NamespaceGuard {
    /// A guard for one rendering, shared by the filter's calls.
    pub fn new() -> Arc<Mutex<NamespaceGuard>> {
        Arc::new(Mutex::new(NamespaceGuard {
            plain: HashMap::new(),
            visits_left: VISIT_BUDGET,
        }))
    }

    /// `value` when it is plain data, an error naming what it holds otherwise. A lazy
    /// sequence (`ns.items + [x]` makes one) is stored as the list it yields, as Jinja does.
    pub fn check(&mut self, value: Value) -> Result<Value, Error> {
        let value = if value.kind() == ValueKind::Iterable {
            let mut items = Vec::new();
            for item in value.try_iter()? {
                self.visit()?;
                items.push(item);
            }
            Value::from(items)
        } else {
            value
        };
        let mut todo = vec![value.clone()];
        while let Some(v) = todo.pop() {
            self.visit()?;
            match v.kind() {
                ValueKind::Undefined
                | ValueKind::None
                | ValueKind::Bool
                | ValueKind::Number
                | ValueKind::String
                | ValueKind::Bytes => {}
                ValueKind::Seq | ValueKind::Map => {
                    let Some(at) = container_address(&v) else {
                        return Err(not_plain(&v));
                    };
                    if self.plain.contains_key(&at) {
                        continue;
                    }
                    if v.kind() == ValueKind::Map {
                        for key in v.try_iter()? {
                            todo.push(v.get_item(&key)?);
                            todo.push(key);
                        }
                    } else {
                        todo.extend(v.try_iter()?);
                    }
                    // Marked before its items are checked: if one is not plain, the whole
                    // rendering fails, so the mark is never relied on.
                    self.plain.insert(at, v);
                }
                _ => return Err(not_plain(&v)),
            }
        }
        Ok(value)
    }

    fn visit(&mut self) -> Result<(), Error> {
        if self.visits_left == 0 {
            return Err(Error::new(
                ErrorKind::OutOfFuel,
                "namespace assignments checked too many values",
            ));
        }
        self.visits_left -= 1;
        Ok(())
    }
}

/// Where a list or map built by the engine keeps its items; `None` for any other object
/// (a namespace is a map-like object of its own type).
fn container_address(v: &Value) -> Option<usize> {
    if let Some(list) = v.downcast_object_ref::<Vec<Value>>() {
        return Some(list as *const Vec<Value> as usize);
    }
    v.downcast_object_ref::<BTreeMap<Value, Value>>()
        .map(|map| map as *const BTreeMap<Value, Value> as usize)
}

fn not_plain(v: &Value) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "a namespace attribute may hold strings, numbers, booleans, none, lists and maps, \
             not a {} (a namespace that can reach itself would never finish printing)",
            v.kind()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guarded(src: &str) -> String {
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .unwrap();
        guard_assignments(src, syntax).unwrap()
    }

    #[test]
    fn attribute_assignments_are_routed_through_the_check_and_names_are_not() {
        assert_eq!(
            guarded("{% set x = 1 %}{%- set ns.a = x, 2 -%}{% set ns.b | trim %} t {% endset %}"),
            "{% set x = 1 %}{%- set ns.a = ( x, 2 )|__spillway_plain_value -%}\
             {% set ns.b | trim |__spillway_plain_value %} t {% endset %}"
        );
        // A block without filters assigns its text; strings and raw blocks are not statements.
        let untouched = "{% set ns.c %}{{ ns }}{% endset %}{{ '{% set ns.d = ns %}' }}\
            {% raw %}{% set ns.e = ns %}{% endraw %}";
        assert_eq!(guarded(untouched), untouched);
    }

    #[test]
    fn plain_data_passes_and_containers_are_checked_once() {
        let guard = NamespaceGuard::new();
        let list = Value::from(vec![Value::from(1), Value::from("a")]);
        let nested = Value::from(vec![list.clone(), list.clone()]);
        assert_eq!(guard.lock().check(nested.clone()).unwrap(), nested);
        let left = guard.lock().visits_left;
        // The outer list is already known plain: one visit.
        guard.lock().check(nested).unwrap();
        assert_eq!(guard.lock().visits_left, left - 1);
        let ns = minijinja::functions::namespace(None).unwrap();
        let e = guard.lock().check(Value::from(vec![ns])).unwrap_err();
        assert!(e.to_string().contains("not a map"), "{e}");
    }
}
