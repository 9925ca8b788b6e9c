//! Chat templates: a conversation (`messages`) rendered into the one string a model is trained on,
//! the way transformers' `apply_chat_template(messages, tokenize=False)` renders it.
//!
//! transformers compiles the template with Jinja2 (`ImmutableSandboxedEnvironment` with
//! `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `raise_exception` function
//! and a `tojson` filter that is Python's `json.dumps` with `ensure_ascii=False`) and renders it
//! with `messages`, `tools` and `documents` (none), `add_generation_prompt` and the tokenizer's
//! named special tokens (`bos_token`, `eos_token`, ...). This module sets up minijinja the same
//! way, and prints values as Python does (`None`, `True`, `1.0`, `['a']`), since Jinja2 prints
//! their Python `str`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, Output, State, UndefinedBehavior, Value};

use crate::{Error, Result};

/// The template's name inside its environment (no extension, so no auto-escaping is derived).
const NAME: &str = "chat_template";

/// A compiled chat template, with where it came from for error messages.
#[derive(Debug, Clone)]
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    origin: String,
}

impl ChatTemplate {
    /// Compiles `source` (read from `origin`, a file or a file's field, named in errors).
    pub(crate) fn new(source: &str, origin: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Jinja2's default: a single trailing newline of the template is dropped.
        env.set_keep_trailing_newline(false);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_formatter(python_formatter);
        // Python's str/dict/list methods (`.strip()`, `.startswith()`, `.items()`, ...), which
        // the chat templates of real models call.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, without_generation_tags(source))
            .map_err(|e| {
                Error::Text(format!(
                    "the chat template of {origin} is not a template minijinja can compile: {e:#}; \
                     fix the template there (it is Jinja, as transformers renders it)"
                ))
            })?;
        Ok(Self { env, origin })
    }

    /// Renders a conversation as `apply_chat_template(messages, tokenize=False)` does, with
    /// `add_generation_prompt` false (a training example ends with the last message) and the
    /// tokenizer's named special tokens (`bos_token`, ...) as variables.
    pub(crate) fn render(
        &self,
        messages: &serde_json::Value,
        special_tokens: &BTreeMap<String, String>,
    ) -> Result<String> {
        match messages.as_array() {
            Some(list) if !list.is_empty() => {}
            Some(_) => {
                return Err(Error::Text(
                    "cannot apply the chat template to an empty conversation: `messages` needs at \
                     least one {\"role\", \"content\"} object"
                        .into(),
                ))
            }
            None => {
                return Err(Error::Text(format!(
                    "`messages` must be a JSON list of {{\"role\", \"content\"}} objects, not {}",
                    kind_of(messages)
                )))
            }
        }
        let mut context: BTreeMap<String, Value> = special_tokens
            .iter()
            .map(|(name, token)| (name.clone(), Value::from(token.as_str())))
            .collect();
        context.insert("messages".into(), Value::from_serialize(messages));
        context.insert("tools".into(), Value::from(()));
        context.insert("documents".into(), Value::from(()));
        context.insert("add_generation_prompt".into(), Value::from(false));
        let template = self.env.get_template(NAME).map_err(|e| {
            Error::Text(format!(
                "the chat template of {} is missing: {e}",
                self.origin
            ))
        })?;
        template.render(Value::from_iter(context)).map_err(|e| {
            let fix = if e.kind() == ErrorKind::InvalidOperation {
                "the template refused this conversation (raise_exception): give it the roles and \
                 order it expects"
            } else {
                "check that the conversation has the fields the template reads, or fix the template"
            };
            Error::Text(format!(
                "rendering the chat template of {} failed: {e:#}; {fix}",
                self.origin
            ))
        })
    }
}

/// The kind of a JSON value, for error messages.
fn kind_of(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// transformers' `raise_exception(message)`: stops rendering with the template's message.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// Replaces transformers' `{% generation %}` / `{% endgeneration %}` block tags (its
/// AssistantTracker extension, which marks assistant tokens and otherwise renders the body
/// unchanged) by `{% if true %}` / `{% endif %}`: the same output, including what
/// `trim_blocks`, `lstrip_blocks` and `-` markers strip around block tags.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let body = &tag[2..];
        let marker = body.chars().next().filter(|c| *c == '-' || *c == '+');
        let after_marker = &body[marker.map_or(0, char::len_utf8)..];
        let word_start = after_marker.len() - after_marker.trim_start().len();
        let word: String = after_marker[word_start..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let replacement = match word.as_str() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(replacement) => {
                out.push_str("{%");
                if let Some(marker) = marker {
                    out.push(marker);
                }
                out.push_str(&after_marker[..word_start]);
                out.push_str(replacement);
                rest = &after_marker[word_start + word.len()..];
            }
            None => {
                out.push_str("{%");
                rest = body;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Prints a value as Jinja2 does: strings as they are, everything else as Python's `str`.
fn python_formatter(
    out: &mut Output,
    _state: &State,
    value: &Value,
) -> std::result::Result<(), minijinja::Error> {
    if value.is_undefined() {
        return Ok(());
    }
    let text = match value.kind() {
        ValueKind::String => {
            return out
                .write_str(value.as_str().unwrap_or_default())
                .map_err(io)
        }
        _ => python_str(value)?,
    };
    out.write_str(&text).map_err(io)
}

/// A formatting error as minijinja's error.
fn io(_: std::fmt::Error) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::WriteFailure, "writing the rendered chat failed")
}

/// Python's `str(value)` for the values a template meets (JSON data, numbers, booleans, none).
fn python_str(value: &Value) -> std::result::Result<String, minijinja::Error> {
    let mut text = String::new();
    python_repr(value, false, &mut text)?;
    Ok(text)
}

/// Python's `repr` (or `str` at the top level, where strings print bare).
fn python_repr(
    value: &Value,
    quote_strings: bool,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&python_number(value)),
        ValueKind::String if quote_strings => {
            python_quoted(value.as_str().unwrap_or_default(), out)
        }
        ValueKind::String => out.push_str(value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&item, true, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&key, true, out)?;
                out.push_str(": ");
                python_repr(&value.get_item(&key)?, true, out)?;
            }
            out.push('}');
        }
        // Objects of the engine (loop, namespace, macros): what minijinja prints for them.
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// A number as Python prints it: integers as digits, floats as `repr(float)` (`1.0`, `1e+16`).
fn python_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(x) => python_float(x),
        Err(_) => value.to_string(),
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip, in positional notation for
/// decimal exponents from -4 to 15, otherwise scientific with a signed two-digit exponent.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7", "1e16", "0e0".
    let sci = format!("{x:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exponent) {
        let point = exponent + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{int}.{frac}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{exp_sign}{:02}", exponent.abs())
    }
}

/// Python's `repr(str)`: single quotes unless the text has one and no double quote.
fn python_quoted(text: &str, out: &mut String) {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// transformers' `tojson` filter: Python's
/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, with
/// those four as keyword arguments (Jinja's own `tojson` would escape HTML characters).
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.is_integer() => Some(" ".repeat(v.as_i64().unwrap_or(0).max(0) as usize)),
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
        Some(v) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: indent must be a number or a string, not {v}"),
            ))
        }
    };
    // Python's defaults: (", ", ": ") without indent, (",", ": ") with one.
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let item = v.get_item_by_index(0)?;
            let key = v.get_item_by_index(1)?;
            match (item.as_str(), key.as_str()) {
                (Some(item), Some(key)) => (item.to_owned(), key.to_owned()),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings (item, key)",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let dumper = JsonDumper {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    dumper.dump(value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// The options of Python's `json.dumps` that `tojson` passes on.
struct JsonDumper {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonDumper {
    fn dump(
        &self,
        value: &Value,
        level: usize,
        out: &mut String,
    ) -> std::result::Result<(), minijinja::Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
            ValueKind::Number => {
                let x = f64::try_from(value.clone())?;
                // Python writes the special floats as JavaScript names (allow_nan=True).
                out.push_str(&match x {
                    x if x.is_nan() => "NaN".to_owned(),
                    x if x.is_infinite() && x > 0.0 => "Infinity".to_owned(),
                    x if x.is_infinite() => "-Infinity".to_owned(),
                    x => python_float(x),
                });
            }
            ValueKind::String => self.string(value.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container(out, '[', ']', level, items.len(), |i, out| {
                    self.dump(&items[i], level + 1, out)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.container(out, '{', '}', level, keys.len(), |i, out| {
                    let key = &keys[i];
                    match key.kind() {
                        ValueKind::String => self.string(key.as_str().unwrap_or_default(), out),
                        // json.dumps turns number, bool and None keys into strings.
                        _ => self.string(&python_json_key(key), out),
                    }
                    out.push_str(&self.key_sep);
                    self.dump(&value.get_item(key)?, level + 1, out)
                })?;
            }
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: {} values are not JSON serializable", value.kind()),
                ))
            }
        }
        Ok(())
    }

    /// A list or object: items separated, and on their own indented lines with `indent`.
    fn container(
        &self,
        out: &mut String,
        open: char,
        close: char,
        level: usize,
        len: usize,
        mut item: impl FnMut(usize, &mut String) -> std::result::Result<(), minijinja::Error>,
    ) -> std::result::Result<(), minijinja::Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(level + 1));
            }
            item(i, out)?;
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(level));
        }
        out.push(close);
        Ok(())
    }

    /// A JSON string as Python writes it: `"`, `\` and control characters escaped (as
    /// `\n`, `\r`, `\t`, `\b`, `\f` or `\u00XX`), and with `ensure_ascii` everything
    /// outside ASCII's printable range as `\uXXXX` (surrogate pairs above U+FFFF).
    fn string(&self, text: &str, out: &mut String) {
        out.push('"');
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && !(' '..='~').contains(&c) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// How `json.dumps` writes a non-string key: `true`, `null`, a number.
fn python_json_key(key: &Value) -> String {
    match key.kind() {
        ValueKind::None => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number => python_number(key),
        _ => key.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, messages: serde_json::Value) -> String {
        ChatTemplate::new(template, "test".into())
            .unwrap()
            .render(&messages, &BTreeMap::new())
            .unwrap()
    }

    // The expected strings of these tests are what transformers' own compiled template
    // (`_compile_jinja_template`, Jinja2 3.1, CPython 3.11) renders for the same input.

    /// Python's repr(float) for the cases that pick its notation.
    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.0, "123456789012345.0"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (0.0, "0.0"),
            (2.5625, "2.5625"),
            (1234.5678, "1234.5678"),
            (1e300, "1e+300"),
        ];
        for (x, python) in cases {
            assert_eq!(python_float(x), python, "{x}");
        }
    }

    /// `tojson` is `json.dumps(x, ensure_ascii=False, ...)`, keyword arguments included.
    #[test]
    fn tojson_is_python_json_dumps() {
        let messages = serde_json::json!([{"role": "user", "content": "x",
            "meta": {"b": [1, 2.5, null, true], "a": "é\"\\\n\u{1}😀"}}]);
        let t = "{{ messages[0].meta | tojson(sort_keys=true) }}";
        assert_eq!(
            render(t, messages.clone()),
            r#"{"a": "é\"\\\n\u0001😀", "b": [1, 2.5, null, true]}"#
        );
        let t = "{{ messages[0].meta.a | tojson(ensure_ascii=true) }}";
        assert_eq!(
            render(t, messages.clone()),
            r#""\u00e9\"\\\n\u0001\ud83d\ude00""#
        );
        let t = "{{ messages[0].meta | tojson(indent=2, sort_keys=true) }}";
        assert_eq!(
            render(t, messages.clone()),
            "{\n  \"a\": \"é\\\"\\\\\\n\\u0001😀\",\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}"
        );
        let t = "{{ messages[0].meta.b | tojson(separators=(',', ':')) }}";
        assert_eq!(render(t, messages), "[1,2.5,null,true]");
    }

    /// Python's dicts keep insertion order, so a template's dict literal dumps in its order.
    #[test]
    fn dict_literals_keep_their_order() {
        let t = "{{ {'b': 1, 'a': [2, 'x']} | tojson }}|{{ {'b': 1, 'a': 2} }}";
        assert_eq!(
            render(t, serde_json::json!([{"role": "user"}])),
            r#"{"b": 1, "a": [2, "x"]}|{'b': 1, 'a': 2}"#
        );
    }

    /// Jinja2 prints Python's str of a value: `None`, `True`, `['a', 1]`.
    #[test]
    fn values_print_as_python_str() {
        let messages = serde_json::json!([{"role": "user", "content": "it's", "n": null,
            "list": ["a", 1, 1.0, false]}]);
        let t = "{{ messages[0].n }}|{{ add_generation_prompt }}|{{ messages[0].list }}|{{ [messages[0].content] }}|{{ 2.0 }}";
        assert_eq!(
            render(t, messages),
            "None|False|['a', 1, 1.0, False]|[\"it's\"]|2.0"
        );
    }

    /// transformers renders a `{% generation %}` block as its body; with trim_blocks and
    /// lstrip_blocks the tags leave no whitespace behind, as `{% if true %}` does.
    #[test]
    fn generation_blocks_render_their_body() {
        let messages = serde_json::json!([{"role": "assistant", "content": "Hi"}]);
        let tagged = "{% for m in messages %}\n  {%- generation -%}\n{{ m.content }}\n  {% endgeneration %}\n{% endfor %}";
        let plain = "{% for m in messages %}\n  {%- if true -%}\n{{ m.content }}\n  {% endif %}\n{% endfor %}";
        assert_eq!(render(tagged, messages.clone()), render(plain, messages));
        assert_eq!(
            without_generation_tags("{% generation %}a{%+ endgeneration%}{% generations %}"),
            "{% if true %}a{%+ endif%}{% generations %}"
        );
    }

    /// raise_exception stops rendering with the template's message; an empty or non-list
    /// conversation is refused before rendering.
    #[test]
    fn refusals_name_the_problem() {
        let template = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}",
            "test".into(),
        )
        .unwrap();
        let none = BTreeMap::new();
        let err = template
            .render(
                &serde_json::json!([{"role": "assistant", "content": ""}]),
                &none,
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("first must be user"), "{err}");
        let err = template
            .render(&serde_json::json!([]), &none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("empty conversation"), "{err}");
        let err = template
            .render(&serde_json::json!({"role": "user"}), &none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be a JSON list"), "{err}");
        let err = ChatTemplate::new("{% for %}", "FILE".into())
            .unwrap_err()
            .to_string();
        assert!(err.contains("FILE"), "{err}");
    }

    /// Python string methods work, as in the templates of real models (minijinja-contrib).
    #[test]
    fn python_methods_are_available() {
        let messages =
            serde_json::json!([{"role": "user", "content": "  <think>x</think>answer "}]);
        let t = "{{ messages[0].content.strip().split('</think>')[-1] }}|{{ messages[0].content.startswith('  <') }}";
        assert_eq!(render(t, messages), "answer|True");
    }
}
