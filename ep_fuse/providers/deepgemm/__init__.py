"""DeepGEMM provider (optional, Hopper): the FP8 expert GEMMs on a 128-row aligned permute (:mod:`.fp8`)."""
