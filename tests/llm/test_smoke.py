from minisgl import SamplingParams


def test_sampling_params_field_order() -> None:
    import dataclasses

    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert names[:5] == ["temperature", "top_k", "top_p", "ignore_eos", "max_tokens"]
