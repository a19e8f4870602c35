"""Where an attempt's ranks meet: a store service that outlives every rank (see
:mod:`trainguard.rendezvous.service`)."""
