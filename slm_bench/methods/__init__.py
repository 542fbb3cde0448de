"""The papers' methods built on the pieces above: TinyGSM's verifier-guided best-of-N, Phi-4's Pivotal Token Search and its views, and the chain world for testing them."""
