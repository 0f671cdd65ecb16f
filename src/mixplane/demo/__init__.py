"""`make demo`: a small GPT trained on the CPU by data-parallel ranks fed only by mixplane, from demo sources built
from text every machine of this kind has."""
