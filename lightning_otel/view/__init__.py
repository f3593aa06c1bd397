"""The viewer (`lightning-otel view`): a local, read-only web page over a trace store and a run folder.

Pages (server-side HTML, inline SVG charts, the small static files in static/): rollouts (filtered, sorted, paged),
one rollout (its span tree across every trace, messages, tool calls, rewards, errors, a feedback form), its
transitions (tokens coloured by advantage), a task's group, a run's rounds, and two policy versions compared.
It reads through the collector's read-only query endpoint when a collector holds the store, else through a
read-only connection to the file; it writes only human feedback, through the collector's admin route.
"""
