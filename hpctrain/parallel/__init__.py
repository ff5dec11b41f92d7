"""Model parallelism over MPI process groups: a run of W = D x T x P ranks, D data-parallel replicas of a model
split into P pipeline stages of T tensor-parallel ranks each.

`layout` (the (d, t, p) of every rank, the layouts a model and its data allow), `groups` (the communicators,
split from the world with MPI_Comm_split), `tensor` (the tensor-parallel GPT: column- and row-parallel
matmuls, the vocabulary-parallel embedding, head and cross-entropy), `stages` (what one rank holds of the
model, and where its share of each tensor sits in the whole one) and `pipeline` (the 1F1B and GPipe
schedules, activations and their gradients sent between neighbour stages). The trainer's use of them is
`control/hybrid.py`.
"""
