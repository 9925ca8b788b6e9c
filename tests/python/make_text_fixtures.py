"""Writes the fixtures of accelerate-text's tests (tests/fixtures/text/) with Hugging Face
`tokenizers` and `transformers`, so the Rust tests compare token ids and rendered chats against the
libraries every Hugging Face model uses, without Python at test time.

  tokenizer/              a byte-level BPE (GPT-2 / Llama-3 style) trained here on the corpora below
                          with 256 entries in all (`len(tokenizer)`), special tokens <pad> <s> </s>,
                          a post-processor that puts <s> (BOS) in front as Llama's tokenizers do, and
                          a Jinja chat template; saved by transformers' `save_pretrained`
                          (tokenizer.json, tokenizer_config.json, chat_template.jinja, and whatever
                          else that version of transformers writes)
  corpus.jsonl            ~40 short documents, each {"id": n, "text": ..., "title": ...}: Unicode
                          (accents, CJK, emoji), whitespace runs, tabs, newlines, an empty string,
                          text holding the literal special-token strings
  chat.jsonl              conversations, each {"messages": [{"role", "content", ...}, ...]}
  corpus.txt              plain-text lines
  expected.json
      special             bos/eos/pad tokens and ids, len(tokenizer)
      texts[]             for every distinct text of the three corpora: `tokenizer(text)["input_ids"]`
                          with add_special_tokens True and False, from transformers'
                          AutoTokenizer.from_pretrained(tokenizer/); the script asserts that the raw
                          `tokenizers.Tokenizer.from_file(tokenizer/tokenizer.json)` gives the same
      chats[]             for every conversation: `apply_chat_template(messages, tokenize=False)` and
                          `apply_chat_template(messages, tokenize=True)["input_ids"]`
      layouts[]           special-token files (tokenizer_config.json, special_tokens_map.json, either
                          may be absent) next to tokenizer_legacy/tokenizer.json (special tokens
                          only in the vocabulary, so PROBE shows which are registered as special
                          tokens), with the bos/eos/pad ids
                          transformers reads from them and its ids for PROBE: which file wins
      legacy              the same three for tokenizer_legacy/ (texts: those with special-token
                          strings, and a few others)
  tokenizer_legacy/       the same tokenizer laid out as older model directories are, to check that
                          the Rust loader reads them as transformers does: truncation and padding
                          saved in tokenizer.json (ignored by tokenizer(text)), the special tokens only in
                          the BPE vocabulary (not in tokenizer.json's added_tokens, so transformers
                          registers them as special tokens on loading), bos_token as an AddedToken
                          object, the chat templates as a named list inside tokenizer_config.json,
                          and a special_tokens_map.json whose eos_token overrides the config's
                          (transformers 5 lets it when the config has no added_tokens_decoder)

The tokenizer is trained on the documents it is tested on, so every character of the corpora is in
its alphabet (a byte-level BPE without the full 256-byte alphabet drops bytes it never saw).
The output is deterministic: the training text is fixed and BPE training is deterministic.

Usage (from the repository root): python3 tests/python/make_text_fixtures.py [OUT_DIR]
Needs tokenizers (0.23) and transformers (5.x) with jinja2.
"""

import json
import os
import shutil
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
VOCAB_SIZE = 256

# A ChatML-like template laid out over lines and indented, so the output depends on Jinja's
# trim_blocks and lstrip_blocks as transformers sets them; it uses bos_token, eos_token,
# raise_exception, loop variables, `is defined`, the `trim` and `tojson` filters and
# add_generation_prompt, as the chat templates of real models do.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if loop.first and message['role'] != 'system' %}
<|system|>
You are a helpful assistant.{{ eos_token }}
    {% endif %}
<|{{ message['role'] }}|>
    {% if message['name'] is defined %}
[name={{ message['name'] | tojson }}]
    {% endif %}
    {% if message.meta is defined %}
[meta={{ message.meta | tojson }}]
    {% endif %}
{{ message['content'] | trim }}{{ eos_token }}
    {% if not loop.last %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "   leading spaces and trailing spaces   ",
    "tabs\there\t\tand\t\t\tthere",
    "line one\nline two\n\nline four after a blank line",
    "mixed \t \n whitespace \r\n runs",
    "Crème brûlée, façade, naïve, über, señor, smørrebrød.",
    "Ça va? Où est la bibliothèque? Très bien, merci.",
    "日本語のテキストです。東京は大きい都市です。",
    "中文文本：你好，世界！",
    "한국어 문장도 있습니다.",
    "Emoji: 😀🎉🚀 and a family 👨‍👩‍👧 with a joiner.",
    "Flags 🇫🇷🇯🇵 and hearts ❤️💙",
    "Ελληνικά: καλημέρα κόσμε",
    "Русский текст: привет, мир",
    "Math: ∑ x² ≤ ∞, π ≈ 3.14159, α+β=γ",
    "<s>",
    "</s>",
    "<pad>",
    "text with <s> inside and </s> at the end</s>",
    "<s><s></s><pad>",
    "almost special: < s > and <s and s> and </ s>",
    "def f(x):\n\treturn x * 2\n",
    "for i in range(10):\n    print(i)  # four-space indent",
    "{\"key\": \"value\", \"n\": [1, 2, 3]}",
    "numbers 1234567890 and 3.14 and -42",
    "CAPITALS AND lowercase AND MiXeD",
    "repeated repeated repeated repeated words",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "punctuation!!! ??? ... --- ;;; :::",
    "url https://example.com/path?q=1&r=2#frag",
    "email someone@example.org",
    "zero\u200bwidth space and non\u00a0breaking space",
    "trailing newline\n",
    "\n\nleading newlines",
    "a",
    "The end. Fin. 終わり。🏁",
    "Once upon a time, in a land far away, there lived a tokenizer.",
]

TITLES = [
    "greeting", "pangram", "empty", "space", "spaces", "tabs", "lines", "mixed", "french",
    "questions", "japanese", "chinese", "korean", "emoji", "flags", "greek", "russian", "math",
    "bos", "eos", "pad", "specials inside", "specials only", "near specials", "python", "loop",
    "json", "numbers", "case", "repeats", "run", "punctuation", "url", "email", "invisible",
    "trailing", "leading", "single", "end", "story",
]

LINES = [
    "The first line of a plain-text corpus.",
    "A second line, with  two spaces and a tab\there.",
    "",
    "Une ligne en français, avec des accents: éèêë.",
    "一行の日本語。",
    "Emoji on a line 🎈",
    "   indented line",
    "a line with <s> and </s>",
    "last line",
]

CHATS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi."},
    ],
    [
        {"role": "user", "content": "  What is 2 + 2?  \n"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 × 3?"},
        {"role": "assistant", "content": "9"},
    ],
    [
        {"role": "system", "content": "Réponds en français."},
        {"role": "user", "content": "Comment ça va ?"},
        {"role": "assistant", "content": "Très bien, merci ! 😀"},
    ],
    [
        {"role": "user", "content": "日本語で挨拶してください。", "name": "太郎"},
        {"role": "assistant", "content": "こんにちは！"},
    ],
    [
        {"role": "user", "content": "Write code.\n\tIndented\n\n  spaced", "meta": {"lang": "py", "n": 2}},
        {"role": "assistant", "content": "def f():\n    return <s> + </s>"},
    ],
    [
        {"role": "system", "content": ""},
        {"role": "user", "content": "Quote \"this\" and a backslash \\ please."},
        {"role": "assistant", "content": "Done: \"this\" \\", "name": "bot \"one\""},
    ],
]


def training_text():
    """Everything the tokenizer will ever be asked to encode, so its alphabet covers it."""
    yield from TEXTS
    yield from LINES
    for chat in CHATS:
        for message in chat:
            yield message["content"]
            yield message.get("name", "")
    yield "<|system|>\nYou are a helpful assistant.\n<|user|>\n<|assistant|>\n[name=\"\"]\n[meta={\"\": , }]"


def train(out_dir):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        show_progress=False,
    )
    tok.train_from_iterator(list(training_text()), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # As Llama-3's tokenizer: BOS in front of every sequence (and of the second of a pair).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    tok_dir = os.path.join(out_dir, "tokenizer")
    if os.path.isdir(tok_dir):
        shutil.rmtree(tok_dir)
    fast.save_pretrained(tok_dir)
    return tok_dir


def write_legacy(out_dir, tok_dir):
    legacy = os.path.join(out_dir, "tokenizer_legacy")
    if os.path.isdir(legacy):
        shutil.rmtree(legacy)
    os.makedirs(legacy)
    with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as f:
        tokenizer = json.load(f)
    tokenizer["added_tokens"] = []
    # Truncation and padding saved in tokenizer.json, which transformers' tokenizer(text) ignores.
    tokenizer["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    tokenizer["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": PAD,
    }
    with open(os.path.join(legacy, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False, indent=2)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {
            "__type": "AddedToken",
            "content": BOS,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "eos_token": PAD,
        "chat_template": [
            {"name": "default", "template": CHAT_TEMPLATE},
            {"name": "tool_use", "template": "{{ raise_exception('the tool_use template') }}"},
        ],
    }
    special_tokens_map = {
        "eos_token": {"content": EOS, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "pad_token": PAD,
    }
    for name, value in (("tokenizer_config.json", config), ("special_tokens_map.json", special_tokens_map)):
        with open(os.path.join(legacy, name), "w", encoding="utf-8") as f:
            json.dump(value, f, ensure_ascii=False, indent=2)
            f.write("\n")
    return legacy


def expectations(hf, raw, texts, check_raw):
    """What transformers gives for each text and conversation (and the raw tokenizer, if it must agree)."""
    rows = []
    for text in texts:
        with_special = hf(text, add_special_tokens=True)["input_ids"]
        without = hf(text, add_special_tokens=False)["input_ids"]
        if check_raw:
            assert raw.encode(text, add_special_tokens=True).ids == with_special, text
            assert raw.encode(text, add_special_tokens=False).ids == without, text
        rows.append({"text": text, "ids": with_special, "ids_no_special": without})
    chats = []
    for chat in CHATS:
        rendered = hf.apply_chat_template(chat, tokenize=False)
        # transformers 5 returns a BatchEncoding when tokenize=True (return_dict defaults to True).
        ids = hf.apply_chat_template(chat, tokenize=True)["input_ids"]
        assert ids == hf(rendered, add_special_tokens=False)["input_ids"]
        if check_raw:
            assert ids == raw.encode(rendered, add_special_tokens=False).ids
        chats.append({"messages": chat, "rendered": rendered, "ids": ids})
    special = {
        "bos_token": hf.bos_token,
        "bos_id": hf.bos_token_id,
        "eos_token": hf.eos_token,
        "eos_id": hf.eos_token_id,
        "pad_token": hf.pad_token,
        "pad_id": hf.pad_token_id,
        "vocab_size": len(hf),
    }
    return {"special": special, "texts": rows, "chats": chats}


PROBE = "a<s>b</s>c<pad>"

ADDED_TOKENS_DECODER = {
    str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    for i, t in enumerate([PAD, BOS, EOS])
}

# (tokenizer_config.json or None, special_tokens_map.json or None)
LAYOUTS = [
    # The map overrides the config when the config has no added_tokens_decoder.
    ({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}, {"eos_token": PAD}),
    # With added_tokens_decoder, the map is not read.
    (
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
         "added_tokens_decoder": ADDED_TOKENS_DECODER},
        {"eos_token": PAD, "pad_token": BOS},
    ),
    # The map alone, with an AddedToken object.
    (None, {"bos_token": {"content": BOS, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False}, "pad_token": EOS}),
    # An AddedToken object with __type, and a null token.
    (
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": None,
         "bos_token": {"__type": "AddedToken", "content": EOS, "lstrip": False, "normalized": False,
                       "rstrip": False, "single_word": False, "special": True}},
        None,
    ),
    # Neither file.
    (None, None),
]


def layout_expectations(tok_dir, scratch):
    rows = []
    for config, special_map in LAYOUTS:
        if os.path.isdir(scratch):
            shutil.rmtree(scratch)
        os.makedirs(scratch)
        shutil.copy(os.path.join(tok_dir, "tokenizer.json"), scratch)
        for name, value in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
            if value is not None:
                with open(os.path.join(scratch, name), "w", encoding="utf-8") as f:
                    json.dump(value, f)
        hf = AutoTokenizer.from_pretrained(scratch)
        rows.append({
            "tokenizer_config": config,
            "special_tokens_map": special_map,
            "bos_id": hf.bos_token_id,
            "eos_id": hf.eos_token_id,
            "pad_id": hf.pad_token_id,
            "vocab_size": len(hf),
            "probe": PROBE,
            "probe_ids": hf(PROBE)["input_ids"],
        })
    shutil.rmtree(scratch)
    return rows


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_rows(f, key, rows, indent, last):
    f.write(f'{indent}"{key}": [\n')
    f.write(",\n".join(indent + " " + json.dumps(row, ensure_ascii=False) for row in rows))
    f.write(f"\n{indent}]" + ("\n" if last else ",\n"))


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "fixtures", "text")
    os.makedirs(out, exist_ok=True)
    assert len(TEXTS) == len(TITLES)

    tok_dir = train(out)
    hf = AutoTokenizer.from_pretrained(tok_dir)
    raw = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    assert len(hf) == VOCAB_SIZE, len(hf)

    write_jsonl(
        os.path.join(out, "corpus.jsonl"),
        [{"id": i, "text": t, "title": title} for i, (t, title) in enumerate(zip(TEXTS, TITLES))],
    )
    write_jsonl(os.path.join(out, "chat.jsonl"), [{"messages": chat} for chat in CHATS])
    with open(os.path.join(out, "corpus.txt"), "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in LINES))

    expected = expectations(hf, raw, list(dict.fromkeys(TEXTS + TITLES + LINES)), check_raw=True)

    legacy_dir = write_legacy(out, tok_dir)
    legacy_hf = AutoTokenizer.from_pretrained(legacy_dir)
    legacy_texts = [t for t in TEXTS + LINES if "<" in t] + ["Hello, world!", "", "Crème brûlée 😀"]
    legacy = expectations(legacy_hf, None, legacy_texts, check_raw=False)
    # The layout must not change what transformers does, except where the raw tokenizer differs.
    assert legacy["special"] == expected["special"], legacy["special"]
    assert [c["ids"] for c in legacy["chats"]] == [c["ids"] for c in expected["chats"]]
    raw_legacy = Tokenizer.from_file(os.path.join(legacy_dir, "tokenizer.json"))
    assert raw_legacy.encode("a<s>b").ids != legacy_hf("a<s>b")["input_ids"], "the variant checks nothing"
    expected["legacy"] = legacy
    layouts = layout_expectations(legacy_dir, os.path.join(out, "layout_scratch"))

    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        # One entry a line: small, and diffs stay readable.
        f.write("{\n")
        f.write(f' "special": {json.dumps(expected["special"], ensure_ascii=False)},\n')
        for key in ("texts", "chats"):
            write_rows(f, key, expected[key], " ", last=False)
        write_rows(f, "layouts", layouts, " ", last=False)
        f.write(' "legacy": {\n')
        f.write(f'  "special": {json.dumps(legacy["special"], ensure_ascii=False)},\n')
        for key in ("texts", "chats"):
            write_rows(f, key, legacy[key], "  ", last=key == "chats")
        f.write(" }\n}\n")
    json.load(open(os.path.join(out, "expected.json"), encoding="utf-8"))  # well-formed
    print(f"wrote {out}: {len(expected['texts'])} texts, {len(expected['chats'])} chats, vocab {len(hf)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
