import copy, torch, torch.distributed as dist
import shardtensor
import test_compile as tc

def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tc.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)

def case(gather, backend):
    import torch._dynamo
    model = _llama()
    batches = tc._batches(2)
    plain = copy.deepcopy(model)
    ref = tc._train(plain, plain, batches, sharded=False)
    eager = shardtensor.shard_module(copy.deepcopy(model), gather=gather)
    er = tc._train(eager, eager, batches, sharded=True)
    torch._dynamo.reset(); torch._dynamo.utils.counters.clear()
    sharded = shardtensor.shard_module(model, gather=gather)
    run = torch.compile(sharded, backend=backend, fullgraph=True)
    res = tc._train(sharded, run, batches, sharded=True)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    d_e = max(float((res[1][k] - er[1][k]).abs().max()) for k in er[1])
    d_r = max(float((res[1][k] - ref[1][k]).abs().max()) for k in ref[1])
    return {"breaks": breaks, "losses": res[0], "eager_losses": er[0], "max_diff_vs_eager": d_e, "max_diff_vs_unsharded": d_r}
