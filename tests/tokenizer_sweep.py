"""The reference side of the WordPiece tests in tests/test_encoder.cpp: Hugging Face's tokenizer
on every code point, and on a sweep of strings built to reach every class of Unicode input.

    python tokenizer_sweep.py MODEL_DIR BLOCKS CHARS CASES

BLOCKS (read): Unicode's blocks, one "first last" (hex) a line; the C++ side writes ICU's.
CHARS (written): every code point but the surrogates and '|', in blocks of 64, one line per
    block: the model's BertNormalizer (its tokenizer.json) on the block joined by '|', a tab,
    then a letter per code point for BertPreTokenizer: w (white space: dropped), p (punctuation:
    a word of its own), l (part of a word).
CASES (written): one line per string of the sweep: a label, its UTF-8 bytes in hex (ill-formed
    ones included), the ids of BertTokenizerFast(vocab=MODEL_DIR's vocab.txt) uncased as the
    model is, then cased; tab-separated, ids space-separated, [CLS] and [SEP] included. A case's
    text is its bytes decoded with errors="replace", as Python reads ill-formed UTF-8.

The uncased ids are checked against the model's tokenizer.json too: the two references agree or
this exits 1. Unicode here: Python's unicodedata (which chooses the cases) is Unicode 14.0;
tokenizers' Rust code has tables of its own (see examples/encoder/bert_unicode.hpp), and the
code points where they and Unicode 14.0 disagree are cases of the sweep.
"""
import os
import sys
import unicodedata

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK = 64
ALL = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and c != ord("|")]


def chars(tokenizer, output):
    """Writes CHARS; returns each code point's normalized text and class, by code point."""
    normalizer, pre_tokenizer = tokenizer.normalizer, tokenizer.pre_tokenizer
    result = {}
    with open(output, "w", encoding="utf-8", newline="\n") as out:
        for start in range(0, len(ALL), BLOCK):
            points = ALL[start:start + BLOCK]
            block = [chr(c) for c in points]
            normalized = normalizer.normalize_str("|".join(block))
            # Between letters (at odd offsets): a punctuation mark is a word of one character,
            # white space is in no word, anything else joins its neighbours.
            classes = ["w"] * len(block)
            for _, (begin, end) in pre_tokenizer.pre_tokenize_str("a".join(block)):
                first, last = (begin + 1) // 2, (end + 1) // 2  # the block's points in the word
                classes[first:last] = ["p" if end - begin == 1 else "l"] * (last - first)
            out.write(normalized + "\t" + "".join(classes) + "\n")
            result.update(zip(points, zip(normalized.split("|"), classes)))
    return result


# Python's Unicode 14.0 categories of every code point.
CATEGORIES = [unicodedata.category(chr(c)) for c in range(0x110000)]
ASCII_PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
EXPECTED_GONE_OR_SPLIT = {"Cc", "Cf", "Co", "Mn", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po"}


def disagreements(reference):
    """The code points whose fate in the reference is not what Unicode 14.0's category says:
    removed (Cc, Cf, Co) or stripped (Mn, also after NFD), split off (P*), or neither."""
    points = []
    for c, (normalized, kind) in reference.items():
        category = CATEGORIES[c]
        if kind == "l" and normalized and category not in EXPECTED_GONE_OR_SPLIT:
            continue  # kept by both: letters, numbers, symbols, other marks, unassigned
        if kind == "w" or c in (0, 0xFFFD):
            continue
        gone = category in ("Cc", "Cf", "Co") or all(
            CATEGORIES[ord(x)] == "Mn" for x in unicodedata.normalize("NFD", chr(c)))
        punctuation = category[0] == "P" or (c < 128 and chr(c) in ASCII_PUNCTUATION)
        if gone != (normalized == "") or punctuation != (kind == "p"):
            points.append(c)
    return points


def category_picks(count=8):
    """A few code points of every general category (Unicode 14.0): the first, the last and
    evenly spaced ones between."""
    by_category = {}
    for c, category in enumerate(CATEGORIES):
        by_category.setdefault(category, []).append(c)
    picks = {}
    for category, points in sorted(by_category.items()):
        step = max(1, (len(points) - 1) // (count - 1))
        picks[category] = sorted(set(points[::step][:count - 1] + [points[-1]]))
    return picks


def encoded(c):
    # A surrogate cannot be in UTF-8: its 3-byte encoding ("CESU") is ill-formed input.
    return chr(c).encode("utf-8", "surrogatepass")


def cases(blocks, unusual):
    out = []

    def add(label, data):
        out.append((label, data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")))

    # Every general category, alone, inside a word and after a capital.
    for category, points in category_picks().items():
        for c in points:
            for context in (b"%s", b"un%sable", b"E%s."):
                add(f"category {category} U+{c:04X}", context.replace(b"%s", encoded(c)))

    # Every code point the reference's Unicode tables and Unicode 14.0 treat differently.
    for c in unusual:
        add(f"tables disagree U+{c:04X}", encoded(c))
        add(f"tables disagree U+{c:04X} in a word", b"un" + encoded(c) + b"able")

    # The edges of every block (ICU's), each +-1, alone and inside a word.
    edges = set()
    for first, last in blocks:
        edges.update({first - 1, first, last, last + 1})
    for c in sorted(c for c in edges if 0 <= c < 0x110000):
        add(f"block edge U+{c:04X}", encoded(c))
        add(f"block edge U+{c:04X} in a word", b"x" + encoded(c) + b"y")

    # The edges of every CJK range of BertNormalizer (and the 0x2B820 of Google's BERT).
    cjk = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
           (0x2B740, 0x2B81F), (0x2B820, 0x2B91F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF),
           (0x2F800, 0x2FA1F)]
    for first, last in cjk:
        for c in (first - 1, first, first + 1, last - 1, last, last + 1):
            for context in ("%s", "a%sb", "%s%s", "A %s."):
                add(f"CJK edge U+{c:04X}", context.replace("%s", chr(c)))

    # Special tokens in every position, next to punctuation, letters, CJK and marks; in other
    # cases and broken up (then they are text).
    for token in ("[MASK]", "[SEP]", "[UNK]", "[PAD]", "[CLS]"):
        inner = token[1:-1]
        for form in (token, token.lower(), "[" + inner.title() + "]", "[ " + inner + " ]",
                     "[" + inner, inner + "]", "[" + inner[:2] + " " + inner[2:] + "]",
                     "\uff3b" + inner + "\uff3d", "[" + inner[:2] + "\x00" + inner[2:] + "]"):
            for context in ("%s", "%s hello", "hello %s", "hello %s world", "x%sy", "x.%s!",
                            "(%s)", "%s%s", "%s %s", "[%s]", "%s.", "\x00%s", "%s\u0301a",
                            "\u4e2d%s\u6587", "\u00e9 %s \u00c9", "Hello, %s! It's %s-like.",
                            "  %s\t\n"):
                add(f"special {form!r} in {context!r}", context.replace("%s", form))
    add("specials back to back", "[CLS][SEP][PAD][UNK][MASK]")
    add("specials nested", "[[MASK]][SEP]]][[PAD")

    # Accents, composed and decomposed, case mappings with and without context.
    for text in ("Caf\u00e9 na\u00efve r\u00e9sum\u00e9", "\u00c0\u00c9\u00ce\u00d5\u00dc \u00e0\u00e9\u00ee\u00f5\u00fc \u00ff",
                 "e\u0301 E\u0301 a\u0316\u0301 a\u0301\u0316", "\u212b\u212a \u00c5ngstr\u00f6m",
                 "\u0130stanbul \u0131", "stra\u00dfe STRASSE \u1e9e", "\u039f\u0394\u039f\u03a3 \u039f\u0394\u039f\u03a3.",
                 "\u01c5emal \u01c8 \u01cb", "\ufb01ne \ufb02ow", "Vi\u1ec7t Nam ti\u1ebfng Vi\u1ec7t",
                 "\ud55c\uad6d\uc5b4 \uc870\uc120\ub9d0", "\u1e0d\u1e25\u1e43", "\u1f08\u03b8\u1fc6\u03bd\u03b1\u03b9",
                 "\u0401\u043b\u043a\u0430 \u0419\u043e\u0434", "a\u0344b", "\u0149 \ufb13", "\u216b \u24b6 \U0001d400",
                 "\U00010400\U00010428", "\U0001e900\U0001e922", "\U00010d50\U00010d51 \ua7cb\ua7dc \u1c89",
                 "\U00016ea0 \ua7ce\ua7d2", "\u0915\u094d\u0937 \u0928\u092e\u0938\u094d\u0924\u0947",
                 "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd", "\u0627\u064e\u0644\u0633\u0651\u064e\u0644\u0627\u0645",
                 "\u0e01\u0e34\u0e19\u0e02\u0e49\u0e32\u0e27", "\u1100\u1161\u11a8 \u3131", "\U00011938 \U00011935\U00011930",
                 "\u1734 \u1885 \ua9bd \U000111c9 \u166d"):
        add(f"accents and case {text!r}", text)
        add(f"accents and case, upper {text!r}", text.upper())

    # max_input_chars_per_word (100), counted after normalization.
    for n in (1, 99, 100, 101, 200):
        add(f"a word of {n} letters", "a" * n)
        add(f"a word of {n} letters, then punctuation", "a" * n + "!")
        add(f"a word of {n} accented letters", "\u00e9" * n)
        add(f"a word of {n} letters and a control", "b" * n + "\x01")
    add("100 letters and a mark", "x" * 100 + "\u0301")
    add("101 letters, one of them a mark", "x" * 100 + "e\u0301")
    add("150 CJK ideographs", "\u4e2d" * 150)
    add("a word of 100 unknown characters", "\u2603" * 100)

    # Empty and white space of every kind, and what looks like it.
    for text in ("", " ", "   ", "\t\n\r", "\x00", "\ufffd", "\u200b", "\x01\x02", "\ufeff"):
        add(f"empty-ish {text!r}", text)
    for c in [c for c in range(0x110000) if chr(c).isspace()] + [0x180E, 0x200B, 0x2060, 0xFEFF, 0x1C, 0x85]:
        add(f"between letters U+{c:04X}", f"a{chr(c)}b")
    for c in list(range(0x20)) + list(range(0x7F, 0xA0)):
        add(f"control U+{c:04X} in a word", f"ab{chr(c)}cd")

    # Ill-formed UTF-8: surrogates, overlong forms, truncations, stray bytes, beyond U+10FFFF.
    for data in (b"\xff", b"a\xffb", b"\xed\xa0\x80", b"x\xed\xbf\xbfy", b"\xed\xa0\x80\xed\xb0\x80",
                 b"\xc0\xaf", b"\xe0\x80\xaf", b"\xe4\xb8", b"\xe4\xb8a", b"ab\xc3", b"\x80abc",
                 b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"[MA\xffSK]", b"\xe4[MASK]",
                 b"caf\xc3", b"\xc3\xa9\xcc"):
        add(f"ill-formed {data!r}", data)

    # Sentences.
    for text in ("Hello, \u4e16\u754c! \u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440. \u0645\u0631\u062d\u0628\u0627 "
                 "\u0628\u0627\u0644\u0639\u0627\u0644\u0645. \u0928\u092e\u0938\u094d\u0924\u0947 "
                 "\u0926\u0941\u0928\u093f\u092f\u093e\u0964",
                 "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c \U0001f642\U0001f44d\U0001f3fd #hashtag @user",
                 "e-mail: a.b@c.de, 3.14, $5, \u00bd \u00b2 \u2153 10\u00b0C \u00a7 \u00b6",
                 "The [MASK] sat on the mat. [SEP] It was [UNK]!",
                 "Don't stop\u2014won\u2019t \u201cquote\u201d \u00abguillemets\u00bb \u2026 \u2018x\u2019"):
        add(f"sentence {text[:24]!r}", text)
    return out


def main(model_dir, blocks_path, chars_path, output):
    from tokenizers import Tokenizer
    from transformers import BertTokenizerFast

    model = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    model.no_truncation()
    model.no_padding()
    unusual = disagreements(chars(model, chars_path))

    vocab = {}
    with open(os.path.join(model_dir, "vocab.txt"), encoding="utf-8") as f:
        for line in f:
            vocab.setdefault(line.rstrip("\r\n"), len(vocab))
    # transformers 5 ignores vocab_file= here: the vocabulary goes in as vocab=.
    uncased = BertTokenizerFast(vocab=vocab, do_lower_case=True)
    cased = BertTokenizerFast(vocab=vocab, do_lower_case=False)
    with open(blocks_path) as f:
        blocks = [tuple(int(x, 16) for x in line.split()) for line in f if line.strip()]
    all_cases = cases(blocks, unusual)
    texts = [data.decode("utf-8", "replace") for _, data in all_cases]
    ids_uncased = uncased(texts)["input_ids"]
    ids_cased = cased(texts)["input_ids"]
    ids_model = [e.ids for e in model.encode_batch(texts)]
    differ = [i for i in range(len(texts)) if ids_model[i] != ids_uncased[i]]
    if differ:
        i = differ[0]
        sys.exit(f"tokenizer.json and BertTokenizerFast(vocab=...) disagree on {len(differ)} of "
                 f"{len(texts)} cases, first {all_cases[i][0]}: {ids_model[i]} vs {ids_uncased[i]}")
    with open(output, "w", encoding="ascii", newline="\n") as out:
        for (label, data), a, b in zip(all_cases, ids_uncased, ids_cased):
            label = label.encode("ascii", "backslashreplace").decode().replace("\t", " ")
            out.write(f"{label}\t{data.hex()}\t{' '.join(map(str, a))}\t{' '.join(map(str, b))}\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
