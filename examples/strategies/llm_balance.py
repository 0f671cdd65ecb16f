from mixplane.planner.cost import backbone_cost
from mixplane.planner.dgraph import DGraph


def llm_balance(ctx, method="greedy", group_size=None):
    """Long/short-sequence balance (seed 001 Fig. 9, LLMBalance): even backbone FLOPs over DP ranks and microbatches."""
    g = DGraph(ctx).mix()  # ① the step's samples, mixed exactly
    g.distribute(axis="DP", group_size=group_size).cost(backbone_cost(ctx.spec))  # ② buckets, bins, cost
    g.balance(method=method, level="inter")  # ③ greedy bin packing of rows onto ranks / microbatches
    return g.broadcast_at("TP").plan()  # ④ only tp = 0 fetches
