"""Which of vLLM's and SGLang's OpenAI-server tests are counted, and why the others are not.

Each file is named by its repository path and the commit of the version measured (vLLM:
vllm-project/vllm, SGLang: sgl-project/sglang). Every test the file holds at that commit is in
exactly one group:
- `counted`: the API surface minisgl claims; these make the score.
- `model_specific`: run and reported, not counted: what they assert is a particular model's words
  or token counts (the peers run a 1-8B model, or another tokenizer), which a 135M model's greedy
  answer cannot be expected to match. The reason says which assertion.
- `out_of_scope`: not run: a feature minisgl does not claim (LoRA, prompt_logprobs, beam search,
  rerank/score endpoints, ...), an engine's internals (unit tests of its Python classes), or a
  deliberate difference; the reason says which.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PeerFile:
    repo: str  # "vllm" or "sglang"
    path: str  # in that repository
    commit: str  # the version measured
    counted: tuple[str, ...] = ()
    model_specific: dict[str, str] = field(default_factory=dict)
    out_of_scope: dict[str, str] = field(default_factory=dict)


# Files the counted tests need beside them (vLLM's fixtures: sample schemas, the basic/ server).
# The fixtures' conftest is taken at test_chat.py's commit, whose tests use its
# sample_structured_outputs_choices (the copy measured defines it; its own commit was not recorded).
SUPPORT_FILES = [
    ("vllm", "tests/entrypoints/conftest.py", "03f5298e5c557f4fb84b83451c515329c27f1fac"),
    ("vllm", "tests/entrypoints/openai/basic/conftest.py", "71baba9f39f2fa7f91bf7eb5d7f2f9374acfecdf"),
]

V = "tests/entrypoints/openai/"
S = "test/srt/openai_server/"
OPT, ZEPHYR, QWEN3 = "facebook/opt-125m", "HuggingFaceH4/zephyr-7b-beta", "Qwen/Qwen3-0.6B"

LORA = "LoRA adapters (--enable-lora / --lora-modules): minisgl serves no adapters"
PROMPT_LOGPROBS = (
    "prompt_logprobs: refused by name (a completion with echo and logprobs gives the prompt's logprobs)"
)
VLLM_UNIT = "a unit test of vLLM's own Python classes, not of the HTTP API"
SGLANG_UNIT = "a unit test of SGLang's own Python functions, not of the HTTP API"
PROMPT_EMBEDS = "prompt_embeds: minisgl takes text and token-id prompts only"
HIDDEN_STATES = "kv_transfer_params / last hidden states: disaggregated serving is not implemented"
OTHER_TOOL_MODEL = (
    "the same requests for another model's tool-call format; minisgl's format follows the served "
    "model's chat template, and these run once, under TestToolChoiceLlama32"
)
OTHER_GRAMMAR_BACKEND = (
    "another grammar backend: minisgl has one (llguidance); the same requests run under "
    "TestJSONModeLLGuidance"
)

FILES = [
    PeerFile(
        "vllm",
        V + "completion/test_completion.py",
        "10efe9463b0a2529746fe5fb81d546cf1062b06c",
        counted=tuple(
            f"{name}[{OPT}]"
            for name in (
                "test_no_logprobs",
                "test_zero_logprobs",
                "test_some_logprobs",
                "test_too_many_completion_logprobs",
                "test_parallel_no_streaming",
                "test_parallel_streaming",
                "test_completion_stream_options",
                "test_invalid_json_schema",
                "test_invalid_regex",
                "test_invalid_grammar",
            )
        )
        + (
            f"test_prompt_logprobs_completion[{OPT}--1]",
            f"test_prompt_logprobs_completion[{OPT}-None]",
            f"test_echo_logprob_completion[1-{OPT}]",
            f"test_echo_logprob_completion[0-{OPT}]",
        ),
        model_specific={
            f"test_single_completion[{OPT}]": "asserts usage.prompt_tokens == 6: OPT's tokenizer "
            "(5 tokens and its BOS) for 'Hello, my name is'",
            f"test_completion_streaming[{OPT}]": "asserts the greedy 5-token completion of 'What is an "
            "LLM?' ends by length with text in its last chunk: SmolLM2 answers EOS at once (text '', "
            "finish_reason stop, 1 completion token), streamed or not",
        },
        out_of_scope={
            f"test_completion_truncation_side_controls_prompt_truncation[{OPT}]": "truncate_prompt_tokens "
            "and truncation_side: refused by choice (a prompt longer than the context is a 400, never cut)",
            f"test_prompt_logprobs_completion[{OPT}-0]": PROMPT_LOGPROBS,
            f"test_prompt_logprobs_completion[{OPT}-1]": PROMPT_LOGPROBS,
            f"test_batch_completions[{OPT}]": "use_beam_search: beam search is not implemented "
            "(refused by name)",
        },
    ),
    PeerFile(
        "vllm",
        V + "chat_completion/test_chat.py",
        "03f5298e5c557f4fb84b83451c515329c27f1fac",
        counted=tuple(
            f"{name}[{ZEPHYR}]"
            for name in (
                "test_no_logprobs_chat",
                "test_zero_logprobs_chat",
                "test_some_logprobs_chat",
                "test_too_many_chat_logprobs",
                "test_chat_streaming",
                "test_chat_completion_stream_options",
                "test_chat_completion_n_parameter_non_streaming",
                "test_chat_completion_n_parameter_streaming",
                "test_chat_completion_n_with_seed",
                "test_chat_completion_n_equals_1",
            )
        )
        + (
            f"test_prompt_logprobs_chat[{ZEPHYR}--1]",
            f"test_prompt_logprobs_chat[{ZEPHYR}-None]",
            "test_structured_outputs_type_error",
            "test_structured_outputs_choice_chat_logprobs",
            "test_response_format_text",
            "test_extra_fields_allowed",
            "test_custom_role",
            "test_long_seed",
        ),
        model_specific={
            f"test_single_chat_session[{ZEPHYR}]": "asserts usage == (5, 37, 42): zephyr's chat "
            "template and tokenizer give the 37 prompt tokens",
            "test_structured_outputs_choice_chat": "asserts the model picks a different language when "
            "told 'I disagree, pick another one'",
            "test_structured_outputs_json_chat": "asserts the model's second employee has another name "
            "and age",
            "test_structured_outputs_regex_chat": "asserts the model's second IP address differs from "
            "its first",
            "test_response_format_json_object": "asserts the model answers 1+1 as {'result': 2}",
            "test_response_format_json_schema": "asserts the model answers 1+1 as {'result': 2}, and "
            "that without a schema it does not",
            "test_complex_message_content": "asserts the model answers 1+1 with exactly '2'",
        },
        out_of_scope={
            **{
                f"{name}[zephyr-lora]": LORA
                for name in (
                    "test_no_logprobs_chat",
                    "test_zero_logprobs_chat",
                    "test_some_logprobs_chat",
                    "test_too_many_chat_logprobs",
                    "test_single_chat_session",
                    "test_chat_streaming",
                    "test_chat_completion_stream_options",
                )
            },
            f"test_prompt_logprobs_chat[{ZEPHYR}-1]": PROMPT_LOGPROBS,
            f"test_prompt_logprobs_chat[{ZEPHYR}-0]": PROMPT_LOGPROBS,
            f"test_more_than_one_prompt_logprobs_chat[{ZEPHYR}]": PROMPT_LOGPROBS,
            "test_invocations": "/invocations (SageMaker's route) is not served",
            "test_chat_completion_request_n_parameter_to_sampling_params": VLLM_UNIT,
            "test_chat_completion_request_n_parameter_default": VLLM_UNIT,
            "test_chat_completion_request_n_parameter_various_values": VLLM_UNIT,
        },
    ),
    PeerFile(
        "vllm",
        V + "chat_completion/test_completion_with_function_calling.py",
        "042807b6623fe3d425966ceb70c18a105338a055",
        counted=(
            f"test_function_tool_use[False-required-True-{QWEN3}]",
            f"test_function_tool_use[False-required-False-{QWEN3}]",
            f"test_function_tool_use[False-tool_choice2-True-{QWEN3}]",
            f"test_function_tool_use[False-tool_choice2-False-{QWEN3}]",
            f"test_no_args_tool_call[{{}}-{QWEN3}]",
            f"test_no_args_tool_call[-{QWEN3}]",
            "test_inconsistent_tool_choice_and_tools",
            "test_max_tokens_with_tool_choice_required[required]",
            "test_max_tokens_with_tool_choice_required[tool_choice1]",
        ),
        model_specific={
            f"test_function_tool_use[False-auto-True-{QWEN3}]": "tool_choice auto: asserts the model "
            "chooses to call a tool",
            f"test_function_tool_use[False-auto-False-{QWEN3}]": "tool_choice auto: asserts the model "
            "chooses to call a tool",
            "test_named_tool_use": "asserts the model's second employee has another name and age",
        },
        out_of_scope={
            f"test_function_tool_use[True-{choice}-{stream}-{QWEN3}]": "enable_thinking: needs a "
            "reasoning model (Qwen3); the embedded SmolLM2 does not think"
            for choice in ("auto", "required", "tool_choice2")
            for stream in ("True", "False")
        },
    ),
    PeerFile(
        "vllm",
        V + "basic/test_chat_echo.py",
        "fa0f818ee338b5aee39c120198651ad80855c51d",
        counted=(
            "test_chat_session_with_echo_and_continue_final_message[True]",
            "test_chat_session_with_echo_and_continue_final_message[False]",
        ),
    ),
    PeerFile(
        "vllm",
        V + "basic/test_return_token_ids.py",
        "06cb65b596ce45980f6c9dd26cac30206680ae25",
        counted=(
            "test_basic_completion_with_emoji",
            "test_chat_completion_with_tool_use",
            "test_chat_completion_with_emoji_and_token_ids",
        ),
        out_of_scope={
            "test_comparison_with_prompt_logprobs_and_logprobs": PROMPT_LOGPROBS
            + "; return_tokens_as_token_ids: refused by name",
        },
    ),
    PeerFile(
        "vllm",
        V + "basic/test_basic.py",
        "35daaf4dd032917896c665abc01dedd7bb4a0ad8",
        counted=("test_check_health[default-frontend-multiprocessing]", "test_request_wrong_content_type"),
        out_of_scope={
            "test_show_version[default-frontend-multiprocessing]": "/version reports vLLM's version",
            "test_show_version[disable-frontend-multiprocessing]": "/version reports vLLM's version",
            "test_check_health[disable-frontend-multiprocessing]": "the same request as the counted "
            "variant; the flag is a vLLM process layout",
            "test_request_cancellation[default-frontend-multiprocessing]": "needs a 10,100-token "
            "context (--max-model-len 10100); the embedded model has 8,192",
            "test_request_cancellation[disable-frontend-multiprocessing]": "needs a 10,100-token "
            "context (--max-model-len 10100); the embedded model has 8,192",
            "test_server_load[enable-server-load-tracking]": "/load (vLLM's load tracking) is not "
            "served; minisgl reports load in /metrics",
            "test_health_check_engine_dead_error": VLLM_UNIT,
        },
    ),
    PeerFile(
        "vllm",
        V + "completion/test_prompt_validation.py",
        "6052d63e3d36b715f4346154bebf3ef80588988c",
        counted=("test_out_of_vocab_token_ids",),
        out_of_scope={
            "test_empty_prompt": PROMPT_EMBEDS,
            "test_load_prompt_embeds[*]": PROMPT_EMBEDS + " (48 unit tests of vLLM's loader)",
            "test_disable_prompt_embeds[2-2-dtype0]": PROMPT_EMBEDS,
            "test_inline_hidden_states_rejects_unsupported_http_shapes[*]": HIDDEN_STATES + " (6 unit tests)",
            "test_inline_hidden_states_rejects_multiple_completion_prompts[*]": HIDDEN_STATES
            + " (2 unit tests)",
            "test_inline_hidden_states_with_concurrent_streaming[*]": HIDDEN_STATES + " (needs Qwen3.5-4B)",
        },
    ),
    PeerFile(
        "vllm",
        V + "chat_completion/test_chat_logit_bias_validation.py",
        "0c292380d4662181b001e8cfaff80f49ffbfd59c",
        counted=(
            "test_chat_logit_bias_valid",
            "test_chat_logit_bias_invalid",
            "test_chat_logit_bias_non_integer_key",
            "test_chat_logit_bias_non_numeric_value",
            "test_chat_logit_bias_multiple_non_integer_keys",
        ),
    ),
    PeerFile(
        "vllm",
        V + "chat_completion/test_chat_stop_token_ids_validation.py",
        "37fa82dee586a01d953581f8937c528b94a2816d",
        counted=(
            "test_chat_stop_token_ids_valid",
            "test_chat_stop_token_ids_out_of_vocab",
            "test_chat_stop_token_ids_negative",
        ),
    ),
    PeerFile(
        "sglang",
        S + "basic/test_openai_server.py",
        "0a0dd3590799de5344ff8db9b1886105d4c18af9",
        counted=tuple(
            f"TestOpenAIServer::{name}"
            for name in (
                "test_completion",
                "test_completion_stream",
                "test_chat_completion",
                "test_chat_completion_stream",
                "test_penalty",
                "test_model_list",
                "test_retrieve_model",
            )
        )
        + tuple(
            f"TestOpenAIServerv1Responses::{name}"
            for name in (
                "test_response",
                "test_response_stream",
                "test_response_completion",
                "test_response_completion_stream",
                "test_error",
                "test_penalty",
                "test_model_list",
            )
        ),
        model_specific={
            f"{cls}::test_regex": "asserts json.loads of the answer held to the test's name/population "
            "regex: the embedded model writes '\"population\": 1111...' until max_tokens (128), so the "
            "JSON is cut before its closing brace"
            for cls in ("TestOpenAIServer", "TestOpenAIServerv1Responses")
        },
        out_of_scope={
            **{
                f"{cls}::test_response_prefill": "asks for 'meta-llama/Llama-3.1-8B-Instruct', a model "
                "the server does not serve (SGLang ignores `model`; minisgl answers 404 as vLLM and "
                'OpenAI do, by choice), and asserts that model\'s words (\'"name": "SmartHome Mini"\')'
                for cls in ("TestOpenAIServer", "TestOpenAIServerv1Responses")
            },
            "TestOpenAIV1Rerank::test_rerank_single": "/v1/rerank: cross-encoder models are not served",
            "TestOpenAIV1Rerank::test_rerank_batch": "/v1/rerank: cross-encoder models are not served",
            "TestOpenAIServerCustomLogitProcessor::test_custom_logit_processor": "custom_logit_processor "
            "(serialized Python run by the server): refused by name, by design",
            "TestOpenAIServerCustomLogitProcessor::test_custom_logit_processor_batch_mixed": "custom_logit_"
            "processor (serialized Python run by the server): refused by name, by design",
            "TestOpenAIV1Score::test_score_text_input": "/v1/score is not served",
            "TestOpenAIV1Score::test_score_token_input": "/v1/score is not served",
            "TestOpenAIV1Score::test_score_error_handling": "/v1/score is not served",
        },
    ),
    PeerFile(
        "sglang",
        S + "validation/test_matched_stop.py",
        "2d369f693bb2faa938c897cc551125ff5529769d",
        counted=("TestMatchedStop::test_finish_stop_str", "TestMatchedStop::test_finish_length"),
        model_specific={
            "TestMatchedStop::test_finish_stop_eos": "asserts matched_stop == 128009, Llama 3's "
            "<|eot_id|> (the embedded model's EOS is another id)",
        },
        out_of_scope={
            "TestMatchedStop::test_finish_stop_regex_str": "stop_regex: not implemented (refused by name)",
            "TestRegexPatternMaxLength::test_get_max_length": SGLANG_UNIT,
        },
    ),
    PeerFile(
        "sglang",
        S + "validation/test_request_length_validation.py",
        "4eb14d27fa0af4d4a10ec63dca37b7f108206c2e",
        counted=(
            "TestRequestLengthValidation::test_input_length_longer_than_context_length",
            "TestRequestLengthValidation::test_input_length_longer_than_maximum_allowed_length",
            "TestRequestLengthValidation::test_max_tokens_validation",
        ),
    ),
    PeerFile(
        "sglang",
        S + "validation/test_openai_server_ignore_eos.py",
        "1740f505dd07164b05607881e4235925ebdb4127",
        counted=("TestOpenAIServerIgnoreEOS::test_ignore_eos",),
    ),
    PeerFile(
        "sglang",
        S + "features/test_continuous_usage_stats.py",
        "adcc3be8bc9790d304a35ff3a16f6585af6dfcb6",
        counted=(
            "TestContinuousUsageStats::test_continuous_usage_stats_enabled",
            "TestContinuousUsageStats::test_continuous_usage_stats_disabled",
            "TestContinuousUsageStats::test_async_runner",
        ),
        out_of_scope={
            "TestContinuousUsageStats::test_continuous_usage_stats_async": "an async method of a "
            "unittest.TestCase: unittest never awaits it, so it passes without sending a request "
            "(test_async_runner runs the same body and is counted)",
        },
    ),
    PeerFile(
        "sglang",
        S + "features/test_json_mode.py",
        "3d7767892cac241b2a2cc967ed871aa3fa0ee99c",
        counted=(
            "TestJSONModeLLGuidance::test_json_mode_response",
            "TestJSONModeLLGuidance::test_json_mode_with_streaming",
        ),
        out_of_scope={
            f"{cls}::{name}": OTHER_GRAMMAR_BACKEND
            for cls in ("TestJSONModeOutlines", "TestJSONModeXGrammar")
            for name in ("test_json_mode_response", "test_json_mode_with_streaming")
        },
    ),
    PeerFile(
        "sglang",
        S + "features/test_openai_server_ebnf.py",
        "41c3e5a4c5fb0114363606c010dcf0377d29acfc",
        counted=("TestOpenAIServerEBNF::test_ebnf", "TestOpenAIServerEBNF::test_ebnf_strict_json"),
    ),
    PeerFile(
        "sglang",
        S + "function_call/test_tool_choice.py",
        "21ff1af011c4b30ac5fe7865c6ebb8533eba0f02",
        counted=tuple(
            f"TestToolChoiceLlama32::{name}"
            for name in (
                "test_tool_choice_auto_non_streaming",
                "test_tool_choice_auto_streaming",
                "test_tool_choice_required_non_streaming",
                "test_tool_choice_required_streaming",
                "test_tool_choice_specific_function_non_streaming",
                "test_tool_choice_specific_function_streaming",
                "test_required_streaming_arguments_chunks_json",
                "test_complex_parameters_required_non_streaming",
                "test_multi_tool_scenario_auto",
                "test_multi_tool_scenario_required",
                "test_error_handling_invalid_tool_choice",
                "test_invalid_tool_missing_name",
                "test_invalid_json_schema_in_tool",
                "test_conflicting_defs_required_tool_choice",
            )
        ),
        out_of_scope={
            "TestToolChoiceQwen25::*": OTHER_TOOL_MODEL + " (14 tests)",
            "TestToolChoiceMistral::*": OTHER_TOOL_MODEL + " (14 tests)",
        },
    ),
]
