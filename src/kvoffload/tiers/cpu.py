"""Former module of the host-memory tier; use ``kvoffload.tiers.host``.

Kept only so that ``kvoffload.engine`` keeps importing until its import lines follow the
rename (that code is being moved elsewhere); nothing else imports it. Remove it then.
"""

from kvoffload.tiers.host import HostTier, HostTierStats

__all__ = ["HostTier", "HostTierStats"]
