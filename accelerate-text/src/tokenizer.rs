//! A Hugging Face tokenizer read from a model directory, giving the ids transformers gives.
//!
//! The tokenizer itself is Hugging Face's `tokenizers` library (the one Python's package and
//! transformers' fast tokenizers wrap), so `encode` is `tokenizer(text)["input_ids"]`. What
//! transformers adds on top is read from the directory the way transformers 5 reads it:
//! the named special tokens (`bos_token`, `eos_token`, `pad_token`, ...) from
//! tokenizer_config.json and, where that file has no `added_tokens_decoder`, from
//! special_tokens_map.json (which then takes precedence); special tokens the vocabulary has
//! but tokenizer.json does not list as added tokens are registered as special, so they are
//! matched in text as transformers matches them; the chat template from chat_template.jinja,
//! else from tokenizer_config.json's `chat_template`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Map, Value};
use tokenizers::AddedToken;

use crate::chat::ChatTemplate;
use crate::document::Content;
use crate::{Error, Result};

/// The tokenizer proper: vocabulary, model, normalizer, pre- and post-processor.
const TOKENIZER_JSON: &str = "tokenizer.json";
/// transformers' settings around it: named special tokens, chat template (older layout).
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// The named special tokens as older transformers versions wrote them.
const SPECIAL_TOKENS_MAP: &str = "special_tokens_map.json";
/// The chat template as transformers 5 writes it.
const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";
/// A sentencepiece model, kept next to tokenizer.json by some models (copied, never read).
const TOKENIZER_MODEL: &str = "tokenizer.model";

/// The files of a model directory that make up its tokenizer, in the order they are saved.
const FILES: [&str; 5] = [
    TOKENIZER_JSON,
    TOKENIZER_CONFIG,
    SPECIAL_TOKENS_MAP,
    CHAT_TEMPLATE_JINJA,
    TOKENIZER_MODEL,
];

/// transformers' named special tokens (`SPECIAL_TOKENS_ATTRIBUTES`), which its chat templates
/// receive as variables.
const NAMED: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A Hugging Face tokenizer with its special tokens and chat template, giving the token ids
/// transformers gives for the same directory. Cheap to share: wrap it in an `Arc` for a
/// loader's workers (it is `Send + Sync`).
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    pad: Option<u32>,
    /// The named special tokens that are set, by attribute name, for the chat template.
    special_tokens: BTreeMap<String, String>,
    chat: Chat,
    /// The tokenizer files as read, by file name, so `save_to` writes exactly what was loaded.
    files: Vec<(&'static str, Vec<u8>)>,
    /// The directory (or lone tokenizer.json) it was read from, for messages.
    origin: PathBuf,
    /// Whether it came from a lone tokenizer.json (`from_file`).
    lone_file: bool,
}

/// The chat template, or why there is none that can be used.
#[derive(Clone, Debug)]
enum Chat {
    /// The directory has no chat template.
    Missing,
    /// A template, compiled.
    Ready(Box<ChatTemplate>),
    /// A template that cannot be used (reported when a conversation needs it, so a tokenizer
    /// used for plain text only still loads).
    Unusable(String),
}

impl Tokenizer {
    /// Reads the tokenizer of a Hugging Face model directory: tokenizer.json (required), and
    /// tokenizer_config.json, special_tokens_map.json and chat_template.jinja where present.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if !dir.exists() {
            return Err(Error::Text(format!(
                "the tokenizer directory {} does not exist: pass the directory of a Hugging Face \
                 model, the one holding tokenizer.json",
                dir.display()
            )));
        }
        if !dir.is_dir() {
            return Err(Error::Text(format!(
                "{} is a file, not a directory: pass the model directory that holds \
                 tokenizer.json (or load a lone tokenizer.json with Tokenizer::from_file)",
                dir.display()
            )));
        }
        let json_path = dir.join(TOKENIZER_JSON);
        if !json_path.is_file() {
            return Err(Error::Text(missing_tokenizer_json(dir)));
        }
        let mut files = Vec::new();
        for name in FILES {
            let path = dir.join(name);
            if path.is_file() {
                files.push((name, read(&path)?));
            }
        }
        let bytes_of = |name: &str| files.iter().find(|(n, _)| *n == name).map(|(_, b)| b);
        let inner = parse_tokenizer(bytes_of(TOKENIZER_JSON).map_or(&[][..], |b| b), &json_path)?;
        let config_path = dir.join(TOKENIZER_CONFIG);
        let config = bytes_of(TOKENIZER_CONFIG)
            .map(|b| json_object(b, &config_path))
            .transpose()?;
        let map_path = dir.join(SPECIAL_TOKENS_MAP);
        let map = bytes_of(SPECIAL_TOKENS_MAP)
            .map(|b| json_object(b, &map_path))
            .transpose()?;
        let jinja_path = dir.join(CHAT_TEMPLATE_JINJA);
        let chat = match bytes_of(CHAT_TEMPLATE_JINJA) {
            Some(bytes) => match std::str::from_utf8(bytes) {
                Ok(source) => compiled(source, jinja_path.display().to_string()),
                Err(e) => Chat::Unusable(format!(
                    "{} is not UTF-8 text ({e}): save the chat template as UTF-8",
                    jinja_path.display()
                )),
            },
            None => config.as_ref().map_or(Chat::Missing, |config| {
                config_template(config, &config_path)
            }),
        };
        let config = config.map(|c| (config_path, c));
        let map = map.map(|m| (map_path, m));
        Self::assemble(inner, config, map, chat, files, dir.to_path_buf(), false)
    }

    /// Reads a lone tokenizer.json: no BOS or EOS (they are named in tokenizer_config.json),
    /// a pad token only if its saved padding names one, no chat template. Use
    /// [`Tokenizer::from_dir`] for a model directory.
    pub fn from_file(path: &Path) -> Result<Self> {
        if path.is_dir() {
            return Err(Error::Text(format!(
                "{} is a directory: use Tokenizer::from_dir for a model directory, or pass the \
                 path of its tokenizer.json",
                path.display()
            )));
        }
        if !path.exists() {
            return Err(Error::Text(format!(
                "the tokenizer file {} does not exist: pass the path of a Hugging Face \
                 tokenizer.json",
                path.display()
            )));
        }
        let bytes = read(path)?;
        let inner = parse_tokenizer(&bytes, path)?;
        let files = vec![(TOKENIZER_JSON, bytes)];
        Self::assemble(
            inner,
            None,
            None,
            Chat::Missing,
            files,
            path.to_path_buf(),
            true,
        )
    }

    /// Resolves the special tokens and sets the tokenizer up as transformers' `__call__` uses it.
    fn assemble(
        mut inner: tokenizers::Tokenizer,
        config: Option<(PathBuf, Map<String, Value>)>,
        map: Option<(PathBuf, Map<String, Value>)>,
        chat: Chat,
        files: Vec<(&'static str, Vec<u8>)>,
        origin: PathBuf,
        lone_file: bool,
    ) -> Result<Self> {
        // A padding setting saved in tokenizer.json names the pad token where no file does
        // (transformers' `kwargs.setdefault("pad_token", padding["pad_token"])`).
        let padding_token = inner.get_padding().map(|p| p.pad_token.clone());
        // transformers calls the tokenizer without truncation or padding unless asked, whatever
        // tokenizer.json says.
        inner
            .with_truncation(None)
            .map_err(|e| Error::Text(format!("cannot turn truncation off: {e}")))?;
        inner.with_padding(None);
        let split_special = config
            .as_ref()
            .and_then(|(_, c)| c.get("split_special_tokens"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        inner.set_encode_special_tokens(split_special);

        let mut tokens = SpecialTokens::resolve(config.as_ref(), map.as_ref())?;
        if let Some(pad) = padding_token.filter(|_| !tokens.pad_token_key) {
            let json_path = if lone_file {
                origin.clone()
            } else {
                origin.join(TOKENIZER_JSON)
            };
            let token = AddedToken::from(pad, true);
            tokens
                .named
                .push(("pad_token".to_owned(), token, json_path));
        }
        // Special tokens (and the config's added tokens) that the vocabulary has but that are
        // not added tokens of tokenizer.json are registered, as transformers does, so that they
        // are matched whole in text.
        let mut to_register = Vec::new();
        for (attr, token, file) in tokens.named.iter().chain(tokens.extra.iter()) {
            if inner.token_to_id(&token.content).is_none() {
                return Err(Error::Text(format!(
                    "{} names {attr} {:?}, which the vocabulary of tokenizer.json does not have \
                     (transformers would add it with a new id the model has no embedding for): \
                     set {attr} in {} to a token of the vocabulary, or add the token to the \
                     tokenizer and resize the model's embeddings",
                    file.display(),
                    token.content,
                    file.display()
                )));
            }
            let added = inner.get_added_vocabulary().get_vocab();
            if !added.contains_key(&token.content)
                && !to_register
                    .iter()
                    .any(|t: &AddedToken| t.content == token.content)
            {
                to_register.push(token.clone());
            }
        }
        let (special, plain): (Vec<AddedToken>, Vec<AddedToken>) =
            to_register.into_iter().partition(|t| t.special);
        let register = |e| Error::Text(format!("registering the special tokens failed: {e}"));
        inner.add_special_tokens(special).map_err(register)?;
        inner.add_tokens(plain).map_err(register)?;
        let id_of = |attr: &str| {
            tokens
                .named
                .iter()
                .find(|(a, _, _)| a == attr)
                .and_then(|(_, t, _)| inner.token_to_id(&t.content))
        };
        let (bos, eos, pad) = (id_of("bos_token"), id_of("eos_token"), id_of("pad_token"));
        let special_tokens = tokens
            .named
            .iter()
            .map(|(attr, token, _)| (attr.clone(), token.content.clone()))
            .collect();
        Ok(Self {
            inner,
            bos,
            eos,
            pad,
            special_tokens,
            chat,
            files,
            origin,
            lone_file,
        })
    }

    /// The ids of `text`: transformers' `tokenizer(text, add_special_tokens=...)["input_ids"]`
    /// (with special tokens: what the post-processor adds, e.g. BOS in front).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| {
                Error::Text(format!(
                    "tokenizing a text of {} bytes with the tokenizer of {} failed: {e}",
                    text.len(),
                    self.origin.display()
                ))
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The ids a document is trained on, ending with EOS so that packed documents stay apart:
    /// text is `encode(text, true)`; a conversation is rendered by the chat template (as
    /// `apply_chat_template(messages, tokenize=False)`) and encoded without special tokens (the
    /// template writes them). EOS is appended unless the ids already end with it.
    pub fn encode_document(&self, doc: &Content) -> Result<Vec<u32>> {
        let eos = self.eos.ok_or_else(|| {
            Error::Text(format!(
                "the tokenizer of {} has no EOS token, which marks where a document ends when \
                 documents are packed together: set eos_token in its tokenizer_config.json",
                self.origin.display()
            ))
        })?;
        let mut ids = match doc {
            Content::Text(text) => self.encode(text, true)?,
            Content::Messages(messages) => self.encode(&self.render_chat(messages)?, false)?,
        };
        if ids.last() != Some(&eos) {
            ids.push(eos);
        }
        Ok(ids)
    }

    /// A conversation (a JSON list of `{role, content, ...}`) rendered by the tokenizer's chat
    /// template: transformers' `apply_chat_template(messages, tokenize=False)`, with
    /// `add_generation_prompt` false since a training example ends with its last message.
    pub fn render_chat(&self, messages: &serde_json::Value) -> Result<String> {
        match &self.chat {
            Chat::Ready(template) => template.render(messages, &self.special_tokens),
            Chat::Unusable(why) => Err(Error::Text(why.clone())),
            Chat::Missing if self.lone_file => Err(Error::Text(format!(
                "the tokenizer {} was read alone (Tokenizer::from_file), without a chat template, \
                 so a conversation (`messages`) cannot be turned into text: read its model \
                 directory with Tokenizer::from_dir",
                self.origin.display()
            ))),
            Chat::Missing => Err(Error::Text(format!(
                "the tokenizer in {} has no chat template (no {CHAT_TEMPLATE_JINJA}, and no \
                 chat_template in {TOKENIZER_CONFIG}), so a conversation (`messages`) cannot be \
                 turned into text: add the model's chat template as {}, or train on plain text",
                self.origin.display(),
                self.origin.join(CHAT_TEMPLATE_JINJA).display()
            ))),
        }
    }

    /// The id of the beginning-of-sequence token, if the tokenizer names one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The id of the end-of-sequence token, if the tokenizer names one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The id of the padding token, if the tokenizer names one.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// A name for exactly this tokenizer: FNV-1a (64 bits) over the files it was read from, in
    /// order, each with its name. Token files record it, so that ids made by another tokenizer
    /// (or another version of its files) are refused instead of silently misread.
    pub fn fingerprint(&self) -> String {
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for (name, bytes) in &self.files {
            for &b in name.as_bytes().iter().chain([0u8].iter()).chain(bytes) {
                hash = (hash ^ u64::from(b)).wrapping_mul(PRIME);
            }
        }
        format!("fnv1a64:{hash:016x}")
    }

    /// The number of ids, added tokens included: transformers' `len(tokenizer)`, the least
    /// vocabulary size a model's embedding needs.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Writes the tokenizer files it was read from (tokenizer.json, and tokenizer_config.json,
    /// special_tokens_map.json, chat_template.jinja, tokenizer.model where they existed) into
    /// `dir`, byte for byte as read, so a checkpoint holds the tokenizer it was trained with.
    /// Each file is written to a temporary file in `dir` and renamed over the target, so a
    /// crash never leaves a half-written tokenizer file. Creates `dir` if needed.
    pub fn save_to(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| {
            Error::Text(format!(
                "cannot create the directory {} to save the tokenizer in: {e}",
                dir.display()
            ))
        })?;
        for (name, bytes) in &self.files {
            write_atomically(&dir.join(name), bytes)?;
        }
        Ok(())
    }
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .field("chat_template", &matches!(self.chat, Chat::Ready(_)))
            .finish()
    }
}

/// The special tokens a directory names, each with the file that named it (for errors).
struct SpecialTokens {
    /// Named tokens (`bos_token`, ..., and the model-specific names of a dict-valued
    /// `extra_special_tokens`), by attribute name.
    named: Vec<(String, AddedToken, PathBuf)>,
    /// Unnamed extra special tokens (`extra_special_tokens` / `additional_special_tokens`), and
    /// the tokens of the config's `added_tokens_decoder` (special or not, as each says).
    extra: Vec<(String, AddedToken, PathBuf)>,
    /// Whether a file read has a `pad_token` key (even null, which means no pad token).
    pad_token_key: bool,
}

impl SpecialTokens {
    /// transformers 5's rule: the config's tokens, overridden by special_tokens_map.json's
    /// unless the config has `added_tokens_decoder` (then the map is not read at all).
    fn resolve(
        config: Option<&(PathBuf, Map<String, Value>)>,
        map: Option<&(PathBuf, Map<String, Value>)>,
    ) -> Result<Self> {
        let map = match config {
            Some((_, c)) if c.contains_key("added_tokens_decoder") => None,
            _ => map,
        };
        let mut named: Vec<(String, AddedToken, PathBuf)> = Vec::new();
        let mut extra = Vec::new();
        for attr in NAMED {
            // The map, where read, takes precedence over the config.
            for (file, object) in map.into_iter().chain(config) {
                if let Some(value) = object.get(attr) {
                    if let Some(token) = added_token(value, attr, file, Some(true))? {
                        named.push((attr.to_owned(), token, file.clone()));
                    }
                    break;
                }
            }
        }
        if let Some((file, object)) = config {
            match object.get("added_tokens_decoder") {
                None | Some(Value::Null) => {}
                Some(Value::Object(by_id)) => {
                    let attr = "added_tokens_decoder";
                    for item in by_id.values() {
                        if let Some(token) = added_token(item, attr, file, None)? {
                            extra.push((attr.to_owned(), token, file.clone()));
                        }
                    }
                }
                Some(other) => {
                    return Err(Error::Text(format!(
                        "{}: added_tokens_decoder should be an object of tokens by id, as \
                         transformers writes it, not {other}: fix or remove it",
                        file.display()
                    )))
                }
            }
        }
        for (file, object) in config.into_iter().chain(map) {
            let list = object
                .get("extra_special_tokens")
                .or_else(|| object.get("additional_special_tokens"));
            match list {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) => {
                    let attr = "extra_special_tokens";
                    for item in items {
                        if let Some(token) = added_token(item, attr, file, Some(true))? {
                            extra.push((attr.to_owned(), token, file.clone()));
                        }
                    }
                }
                // Model-specific named tokens ({"image_token": "<image>"}): named like bos_token.
                Some(Value::Object(by_name)) => {
                    for (attr, item) in by_name {
                        if named.iter().any(|(a, _, _)| a == attr) {
                            continue;
                        }
                        if let Some(token) = added_token(item, attr, file, Some(true))? {
                            named.push((attr.clone(), token, file.clone()));
                        }
                    }
                }
                Some(other) => {
                    return Err(Error::Text(format!(
                        "{}: extra_special_tokens should be a list of tokens or an object of \
                         named tokens, not {other}: fix it there",
                        file.display()
                    )))
                }
            }
        }
        let pad_token_key = map
            .into_iter()
            .chain(config)
            .any(|(_, object)| object.contains_key("pad_token"));
        Ok(Self {
            named,
            extra,
            pad_token_key,
        })
    }
}

/// A token as transformers writes one: a string, or an AddedToken object with `content` (and
/// `lstrip`, `rstrip`, `single_word`, `normalized`, `special`); null for none. `special`
/// forces the token's kind (named special tokens are special whatever the object says);
/// otherwise the object's `special` decides, false by default as in Python's AddedToken.
fn added_token(
    value: &Value,
    attr: &str,
    file: &Path,
    special: Option<bool>,
) -> Result<Option<AddedToken>> {
    let flag = |object: &Map<String, Value>, key: &str, default: bool| {
        object.get(key).and_then(Value::as_bool).unwrap_or(default)
    };
    match value {
        Value::Null => Ok(None),
        Value::String(content) => Ok(Some(AddedToken::from(
            content.clone(),
            special.unwrap_or(false),
        ))),
        Value::Object(object) => match object.get("content") {
            Some(Value::String(content)) => {
                let special = special.unwrap_or_else(|| flag(object, "special", false));
                Ok(Some(
                    AddedToken::from(content.clone(), special)
                        .lstrip(flag(object, "lstrip", false))
                        .rstrip(flag(object, "rstrip", false))
                        .single_word(flag(object, "single_word", false))
                        // Python's AddedToken normalizes the content of non-special tokens by default.
                        .normalized(flag(object, "normalized", !special)),
                ))
            }
            _ => Err(bad_token(value, attr, file)),
        },
        _ => Err(bad_token(value, attr, file)),
    }
}

/// The error for a special token that is neither a string nor an AddedToken object.
fn bad_token(value: &Value, attr: &str, file: &Path) -> Error {
    Error::Text(format!(
        "{}: {attr} should be a token string or an object with a \"content\" string (as \
         transformers writes it), not {value}: fix {attr} there",
        file.display()
    ))
}

/// Why a directory without tokenizer.json cannot be read, and what to do about it.
fn missing_tokenizer_json(dir: &Path) -> String {
    let d = dir.display();
    if dir.join(TOKENIZER_MODEL).is_file() {
        format!(
            "{d} has no tokenizer.json, only a sentencepiece tokenizer.model: convert it once \
             with transformers, python -c \"from transformers import AutoTokenizer; \
             AutoTokenizer.from_pretrained('{d}').save_pretrained('{d}')\", which writes \
             tokenizer.json"
        )
    } else if dir.join("vocab.json").is_file() || dir.join("vocab.txt").is_file() {
        format!(
            "{d} has no tokenizer.json, only the vocabulary files of a slow tokenizer: convert \
             them once with transformers, python -c \"from transformers import AutoTokenizer; \
             AutoTokenizer.from_pretrained('{d}').save_pretrained('{d}')\", which writes \
             tokenizer.json"
        )
    } else {
        format!(
            "there is no tokenizer.json in {d}: a Hugging Face model directory holds one (with \
             transformers, tokenizer.save_pretrained(dir) writes it); pass that directory"
        )
    }
}

/// Parses tokenizer.json with Hugging Face's library.
fn parse_tokenizer(bytes: &[u8], path: &Path) -> Result<tokenizers::Tokenizer> {
    tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| {
        Error::Text(format!(
            "cannot read {} as a Hugging Face tokenizer: {e}; it should be the tokenizer.json \
             that transformers' save_pretrained writes (a newer format may need a newer \
             `tokenizers` crate)",
            path.display()
        ))
    })
}

/// A JSON object file (tokenizer_config.json, special_tokens_map.json).
fn json_object(bytes: &[u8], path: &Path) -> Result<Map<String, Value>> {
    match serde_json::from_slice(bytes) {
        Ok(Value::Object(object)) => Ok(object),
        Ok(other) => Err(Error::Text(format!(
            "{} should hold a JSON object, as transformers writes it, not {}: fix or remove it",
            path.display(),
            match other {
                Value::Array(_) => "a list",
                _ => "a single value",
            }
        ))),
        Err(e) => Err(Error::Text(format!(
            "{} is not valid JSON ({e}): fix or remove it",
            path.display()
        ))),
    }
}

/// The chat template in tokenizer_config.json: a string, or a list of `{name, template}` of
/// which transformers uses the one named "default" for a conversation without tools.
fn config_template(config: &Map<String, Value>, path: &Path) -> Chat {
    let origin = format!("{} (chat_template)", path.display());
    match config.get("chat_template") {
        None | Some(Value::Null) => Chat::Missing,
        Some(Value::String(source)) => compiled(source, origin),
        Some(Value::Array(list)) => {
            let named = |item: &Value| {
                let name = item.get("name")?.as_str()?;
                Some((name.to_owned(), item.get("template")?.as_str()?.to_owned()))
            };
            let templates: Vec<(String, String)> = list.iter().filter_map(named).collect();
            match templates.iter().find(|(name, _)| name == "default") {
                Some((_, source)) => compiled(source, format!("{origin} \"default\"")),
                None => Chat::Unusable(format!(
                    "{origin} lists templates named {:?} but none named \"default\", the one \
                     transformers uses for a conversation: name one of them \"default\"",
                    templates
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                )),
            }
        }
        Some(other) => Chat::Unusable(format!(
            "{origin} should be a template string or a list of {{\"name\", \"template\"}}, not \
             {other}: fix it there"
        )),
    }
}

/// A template compiled, or why it cannot be.
fn compiled(source: &str, origin: String) -> Chat {
    match ChatTemplate::new(source, origin) {
        Ok(template) => Chat::Ready(Box::new(template)),
        Err(e) => Chat::Unusable(e.to_string()),
    }
}

/// A file's bytes, or an error naming it.
fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::Text(format!("cannot read {}: {e}", path.display())))
}

/// Writes `bytes` to a temporary file next to `path`, then renames it over `path`, so that
/// `path` holds either its old content or all of the new one.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = path.with_file_name(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        use std::io::Write as _;
        let mut file = std::fs::File::create(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temp, path)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&temp);
        Error::Text(format!(
            "cannot write the tokenizer file {}: {e}",
            path.display()
        ))
    })
}
