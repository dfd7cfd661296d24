"""The application layer: the context every front door (CLI, API, agent) works in, and
the operations they share. Front doors import from here and from ``fusuma.views``;
never from each other."""
