from mixplane.planner.cost import backbone_cost, encoder_cost
from mixplane.planner.dgraph import DGraph


def vlm_balance(ctx, method="greedy", group_size=None):
    """VLM hybrid balance (seed 001 Fig. 9): images over every encoder rank, text as in LLMBalance."""
    g = DGraph(ctx).mix()
    g.distribute("DP", group_size).cost(backbone_cost(ctx.spec)).balance(method, level="inter")
    img = g.images().distribute("WORLD", group_size).cost(encoder_cost(ctx.spec)).balance(method)
    return g.broadcast_at("TP").plan(img)
