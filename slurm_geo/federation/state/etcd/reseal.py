"""The federation state's values in etcd, as `slurm-geo keys rotate` seals them again
(docs/format.md §8.5; the rotation itself: slurm_geo.ckpt.ops.rotate).

Every value under the prefix that opens under the previous state key is sealed again
under the new one, in place: a compare-and-set on the mod_revision it was read at, its
lease kept (so the leader key stays bound to the leader's lease, and its create_revision,
the leader's term, does not change). A value written meanwhile is read again: the daemons
follow the key file, so what they write during a rotation is sealed under the new key
already. The rotation is no replica and needs no leadership: it changes no value.
"""

from __future__ import annotations

from slurm_geo.ckpt.errors import CkptError
from slurm_geo.ckpt.format.keys import SALT_SIZE, KeyFile, RandomBytes, federation_state_key
from slurm_geo.ckpt.format.seal import Kind, seal
from slurm_geo.ckpt.ops.rotate import CHANGED_TRIES, Judgement, StorePass, Verdict, judge
from slurm_geo.federation.model import FederationStateError
from slurm_geo.federation.state.etcd.kv import EtcdKV, Sealed, sealed_name
from slurm_geo.federation.state.etcd.layout import Layout

# What the ring records among the "stores" a rotation re-seals: a later run must name it.
NAME = "federation-state"


class SealedState:
    def __init__(self, kv: EtcdKV, layout: Layout):
        self.kv, self.layout = kv, layout

    def reseal(self, ring: KeyFile, dry_run: bool, random_bytes: RandomBytes) -> StorePass:
        assert ring.previous is not None, "a ring: the new key and the one it replaces"
        new, previous = federation_state_key(ring.current), federation_state_key(ring.previous)
        done = StorePass()
        try:
            for item in self.kv.range_sealed(self.layout.prefix + "/"):
                judgement = self._reseal(item, new, previous, dry_run, random_bytes)
                if judgement is None:
                    continue  # deleted while we looked
                if judgement.verdict is Verdict.RESEAL:
                    done.rewrapped.append(item.key)
                elif judgement.verdict is Verdict.CURRENT:
                    done.current.append(item.key)
                elif judgement.error is not None:
                    done.refused[item.key] = judgement.error
        except FederationStateError as exc:  # etcd unavailable: this pass is unfinished
            raise CkptError(f"etcd {self.layout.prefix}", str(exc)) from None
        return done

    def _reseal(self, item: Sealed, new: bytes, previous: bytes, dry_run: bool,
                random_bytes: RandomBytes) -> Judgement | None:
        for _ in range(CHANGED_TRIES):
            judgement = judge(item.sealed, item.name, Kind.FEDERATION_STATE, new, previous)
            if judgement.verdict is not Verdict.RESEAL or dry_run:
                return judgement
            again = seal(new, Kind.FEDERATION_STATE, random_bytes(SALT_SIZE),
                         judgement.payload, sealed_name(item.key, item.at.next()))
            if self.kv.replace_sealed(item.key, item.mod_revision, again):
                return judgement
            found = self.kv.get_sealed(item.key)  # written meanwhile: judged again
            if found is None:
                return None
            item = found
        return Judgement(Verdict.REFUSED, error=CkptError(
            item.key, f"'{item.key}' changed under the rotation {CHANGED_TRIES} times; run "
            "it again"))
