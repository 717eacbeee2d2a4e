"""The router's prompt token ids equal what the worker's tokenizer and chat template produce (tiny local model)."""
import pytest

from radix_sync.router.tokenize import BadRequest, PromptTokenizer
from kvrep_dev.cluster import model_path


@pytest.fixture(scope="module")
def tok():
    return PromptTokenizer.from_pretrained(model_path("tiny"))


TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 20, "<|user|>special<|assistant|>", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_generate_text_is_the_tokenizer_call_with_special_tokens(tok, text):
    expected = list(tok.tok(text, add_special_tokens=True)["input_ids"])
    assert tok.prompt_ids("generate", {"text": text}) == expected
    assert tok.prompt_ids("generate", {"text": [text, "other"]}) == expected  # batches: the first prompt
    assert tok.prompt_ids("completions", {"prompt": text}) == expected


def test_token_ids_are_used_as_given(tok):
    assert tok.prompt_ids("generate", {"input_ids": [5, 6, 7]}) == [5, 6, 7]
    assert tok.prompt_ids("generate", {"input_ids": [[5, 6], [7]]}) == [5, 6]
    assert tok.prompt_ids("completions", {"prompt": [9, 8]}) == [9, 8]


CHATS = [
    [{"role": "user", "content": "hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "x" * 300}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_equals_apply_chat_template_with_generation_prompt(tok, messages):
    expected = tok.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    got = tok.prompt_ids("chat", {"messages": messages})
    assert got == list(expected) and len(got) > 0


def test_chat_second_turn_extends_the_first_turn_prefix(tok):
    """What makes a session's second turn hit the first turn's cache."""
    first = [{"role": "user", "content": "Tell me about page tables."}]
    second = first + [{"role": "assistant", "content": "They map pages."}, {"role": "user", "content": "More."}]
    a, b = tok.prompt_ids("chat", {"messages": first}), tok.prompt_ids("chat", {"messages": second})
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common >= len(a) - 2  # all but the generation prompt tokens


def test_chat_as_sglang_normalizes_messages(tok):
    none_content = [{"role": "user", "content": None}]
    assert tok.prompt_ids("chat", {"messages": none_content}) == tok.prompt_ids(
        "chat", {"messages": [{"role": "user", "content": ""}]})
    trailing = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    as_user = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert tok.prompt_ids("chat", {"messages": trailing}) == tok.prompt_ids("chat", {"messages": as_user})


@pytest.mark.parametrize("endpoint,body", [("chat", {"messages": []}), ("generate", {}),
                                           ("generate", {"input_ids": ["a"]}), ("completions", {"prompt": None})])
def test_unreadable_prompts_are_bad_requests(tok, endpoint, body):
    with pytest.raises(BadRequest):
        tok.prompt_ids(endpoint, body)
