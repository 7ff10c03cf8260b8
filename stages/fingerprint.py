"""fingerprint: the params values and code hashes each round stage depends on (rlpipe/fingerprints.py).

Reads params.yaml (every key a round stage reads) and the round stages' code. Writes
runs/fingerprints/{rollout,reward,advantage,update}.json, which the round stages declare instead of
their params and code, so that DVC's bookkeeping per round stays small.
"""

from rlpipe.fingerprints import main

if __name__ == "__main__":
    main()
