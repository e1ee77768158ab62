"""No trainguard import; fails before its first step with a message that looks like rich markup
(gloo's errors start with "[/path/pair.cc:152]")."""

raise RuntimeError(
    "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] [bold]peer[/] closed [red]"
)
