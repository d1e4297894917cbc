"""Several algorithms on one sample stream: what an arm file may change (config), the fan-out of the lead's samples
and a follower's bounded feed (feed), followers as threads of the lead's program (followers), follower programs: the
lead's side (remote) and the program (program), and their outputs under WORKDIR/arms (outputs)."""
