"""The caches: the pools keeping accounting, storage and the prefix index in step (`pool`),
the read-only queries (`queries`), `BatchedSequenceCache` composing the parts (`batched`),
one sequence on it (`single`) and its BatchControl face (`sequence_control`)."""
