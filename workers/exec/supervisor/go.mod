module kiln/exec/supervisor

go 1.22
