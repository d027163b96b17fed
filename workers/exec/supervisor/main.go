// The exec runner's supervisor: the trusted half of a one-shot call, inside a warm runner container.
//
// "serve" runs as root with only CAP_SETUID, CAP_SETGID and CAP_KILL, reads one JSON call per line on stdin and
// answers one JSON line per call on stdout. Per call it prepares /work as uid 1000 (the image's /work, then the
// call's files), runs each step as uid 1000 in a session of its own, reads the step's stdout and stderr from pipes
// it alone holds, measures exit status and time itself, then kills every uid-1000 process, fetches the asked files
// and wipes every writable place (/work, /tmp, /dev/shm, /dev/mqueue, System V IPC). It answers "clean": false when
// anything of the call survives, and the worker then discards the container. The judged code runs under another uid
// than the supervisor and the supervisor is not dumpable, so it can neither open the supervisor's descriptors
// (/proc/<pid>/fd needs ptrace rights over it) nor signal it: the verdict is out of its reach.
//
// The helpers "prepare", "fetch" and "wipe" are this binary again, started as uid 1000 by serve; they never run
// beside judged code.
package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

const (
	self      = "/kiln/sup"
	baseTar   = "/kiln/work.tar"
	untrusted = 1000
)

var writable = []string{"/work", "/tmp", "/dev/shm", "/dev/mqueue"}

type file struct {
	Path string `json:"path"`
	Data string `json:"data"`
	Mode uint32 `json:"mode"`
}

type step struct {
	Name      string  `json:"name"`
	Command   string  `json:"command"`
	TimeoutMs int64   `json:"timeout_ms"`
	Stdin     *string `json:"stdin"`
	Always    bool    `json:"always"`
}

type call struct {
	Files    []file            `json:"files"`
	Steps    []step            `json:"steps"`
	Env      map[string]string `json:"env"`
	Cwd      string            `json:"cwd"`
	Cap      int               `json:"cap"`
	Fetch    []string          `json:"fetch"`
	FetchCap int               `json:"fetch_cap"`
	Base     *string           `json:"base"`
}

type stepResult struct {
	Name            string `json:"name"`
	ExitCode        *int   `json:"exit_code"`
	Signal          int    `json:"signal"`
	TimedOut        bool   `json:"timed_out"`
	WallUs          int64  `json:"wall_us"`
	CPUUs           int64  `json:"cpu_us"`
	Stdout          string `json:"stdout"`
	Stderr          string `json:"stderr"`
	StdoutTruncated bool   `json:"stdout_truncated"`
	StderrTruncated bool   `json:"stderr_truncated"`
	Killed          int    `json:"killed"`
}

type reply struct {
	Steps   []stepResult      `json:"steps"`
	Files   map[string]string `json:"files"`
	Missing []string          `json:"missing"`
	Clean   bool              `json:"clean"`
	Residue string            `json:"residue,omitempty"`
	Error   string            `json:"error,omitempty"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: sup serve|prepare|fetch|wipe")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve()
	case "prepare":
		err = prepare()
	case "fetch":
		err = fetch()
	case "wipe":
		err = wipe()
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// --- serve (root) ------------------------------------------------------------------------------------------------

func serve() error {
	// Not dumpable: no process of another uid may open /proc/<this>/fd, mem or environ, even one that could ptrace.
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, syscall.PR_SET_DUMPABLE, 0, 0); e != 0 {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE): %v", e)
	}
	prestartThreads(reservedThreads)
	in := bufio.NewReaderSize(os.Stdin, 1<<20)
	out := bufio.NewWriter(os.Stdout)
	for {
		line, err := in.ReadBytes('\n')
		if len(bytes.TrimSpace(line)) > 0 {
			var c call
			var r reply
			if jerr := json.Unmarshal(line, &c); jerr != nil {
				r = reply{Error: "malformed call: " + jerr.Error(), Clean: true}
			} else {
				r = run(&c)
			}
			encoded, _ := json.Marshal(r)
			out.Write(encoded)
			out.WriteByte('\n')
			out.Flush()
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

// reservedThreads: OS threads started before any call. A step shares the container's pids limit with this process,
// and a fork bomb exhausts it: were the Go runtime to need a new thread then (a goroutine blocked in a syscall while
// the timer's goroutine reads /proc), the clone would fail and the runtime abort ("newosproc"), so the call would end
// without its measured verdict — the completion's own failure turned into kiln's. Idle threads are reused, never
// freed, so the runtime never needs to start one during a call.
const reservedThreads = 4

// prestartThreads makes the runtime start n OS threads at once (each goroutine locked to its own), then leaves
// them idle: unlocked before they end, the threads go back to the runtime's pool.
func prestartThreads(n int) {
	var started, release sync.WaitGroup
	started.Add(n)
	release.Add(1)
	var done sync.WaitGroup
	done.Add(n)
	for i := 0; i < n; i++ {
		go func() {
			defer done.Done()
			runtime.LockOSThread()
			started.Done()
			release.Wait()
			runtime.UnlockOSThread()
		}()
	}
	started.Wait()
	release.Done()
	done.Wait()
}

func run(c *call) reply {
	r := reply{Files: map[string]string{}, Missing: []string{}, Steps: []stepResult{}}
	if c.Base != nil { // the image's /work, restored at the start of every call
		data, err := base64.StdEncoding.DecodeString(*c.Base)
		if err == nil {
			err = os.WriteFile(baseTar, data, 0o644)
		}
		if err != nil {
			r.Error = "storing the image's /work: " + err.Error()
			return r
		}
	}
	callJSON, _ := json.Marshal(c)
	if out, err := helper("prepare", callJSON, 1<<16); err != nil {
		r.Error = fmt.Sprintf("preparing /work: %v: %s", err, out)
		r.Clean = finish(&r)
		return r
	}
	failed := false
	for _, s := range c.Steps {
		if failed && !s.Always {
			continue
		}
		res := runStep(c, s)
		r.Steps = append(r.Steps, res)
		if res.ExitCode == nil || *res.ExitCode != 0 {
			failed = true
		}
	}
	if len(c.Fetch) > 0 {
		args, _ := json.Marshal(map[string]any{"paths": c.Fetch, "cwd": c.Cwd, "cap": c.FetchCap})
		out, err := helper("fetch", args, c.FetchCap*2+(1<<20))
		if err != nil {
			r.Error = fmt.Sprintf("fetching files: %v", err)
		} else {
			var fetched struct {
				Files   map[string]string `json:"files"`
				Missing []string          `json:"missing"`
			}
			if jerr := json.Unmarshal(out, &fetched); jerr != nil {
				r.Error = "fetching files: " + jerr.Error()
			} else {
				r.Files, r.Missing = fetched.Files, fetched.Missing
			}
		}
	}
	r.Clean = finish(&r)
	return r
}

// finish kills what is left of the call and wipes its places; whether nothing of it survived.
func finish(r *reply) bool {
	if n := killAll(); n < 0 {
		r.Residue = "processes survive SIGKILL"
		return false
	}
	if out, err := helper("wipe", nil, 1<<16); err != nil {
		r.Residue = strings.TrimSpace(fmt.Sprintf("wiping: %v %s", err, out))
		return false
	}
	if left := untrustedPids(); len(left) > 0 {
		r.Residue = fmt.Sprintf("%d processes appeared while wiping", len(left))
		return false
	}
	return true
}

func credential() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: untrusted, Gid: untrusted, Groups: []uint32{}},
		Setsid:     true,
		Pdeathsig:  syscall.SIGKILL,
	}
}

func baseEnv(extra map[string]string) []string {
	env := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	env["HOME"] = "/tmp"
	env["PYTHONDONTWRITEBYTECODE"] = "1"
	for k, v := range extra {
		env[k] = v
	}
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	return out
}

// helper runs this binary as uid 1000 in `mode` with `input` on stdin; its stdout, at most `limit` bytes.
func helper(mode string, input []byte, limit int) ([]byte, error) {
	cmd := exec.Command(self, mode)
	cmd.SysProcAttr = credential()
	cmd.Dir = "/"
	// One P: the helper needs as few threads as it can, out of the pids a small limit leaves beside this process.
	cmd.Env = baseEnv(map[string]string{"GOMAXPROCS": "1"})
	cmd.Stdin = bytes.NewReader(input)
	var stdout, stderr capped
	stdout.cap, stderr.cap = limit, 4096
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	killAll() // a helper leaves nothing behind either
	if err != nil {
		return stderr.buf.Bytes(), err
	}
	if stdout.cut {
		return nil, fmt.Errorf("%s answered more than %d bytes", mode, limit)
	}
	return stdout.buf.Bytes(), nil
}

type capped struct {
	buf   bytes.Buffer
	cap   int
	cut   bool
	total int64
}

func (c *capped) Write(p []byte) (int, error) {
	c.total += int64(len(p))
	room := c.cap - c.buf.Len()
	if room >= len(p) {
		c.buf.Write(p)
	} else {
		if room > 0 {
			c.buf.Write(p[:room])
		}
		c.cut = true
	}
	return len(p), nil
}

func runStep(c *call, s step) stepResult {
	res := stepResult{Name: s.Name}
	outR, outW, err1 := os.Pipe()
	errR, errW, err2 := os.Pipe()
	if err1 != nil || err2 != nil {
		res.Stderr = base64.StdEncoding.EncodeToString([]byte("kiln: no pipes for the step"))
		return res
	}
	dir := filepath.Join("/work", c.Cwd)
	cmd := exec.Command("bash", "-c", s.Command)
	cmd.SysProcAttr = credential()
	cmd.Dir = dir
	cmd.Env = baseEnv(c.Env)
	cmd.Stdout, cmd.Stderr = outW, errW
	if s.Stdin != nil {
		input, err := stdinFile(*s.Stdin)
		if err != nil {
			outR.Close()
			errR.Close()
			outW.Close()
			errW.Close()
			res.Stderr = base64.StdEncoding.EncodeToString([]byte("kiln: the step's stdin: " + err.Error()))
			return res
		}
		defer input.Close()
		cmd.Stdin = input
	}
	stdout, stderr := &capped{cap: c.Cap}, &capped{cap: c.Cap}
	var readers sync.WaitGroup
	readers.Add(2)
	go func() { io.Copy(stdout, outR); readers.Done() }()
	go func() { io.Copy(stderr, errR); readers.Done() }()
	started := time.Now()
	// The step inherits an OOM score of 1000 (the first to go when the runner's memory runs out), set on this
	// process just for the fork: raising it needs no capability, and lowering back to 0 stays within what this
	// process was given.
	oomScore("1000")
	startErr := cmd.Start()
	oomScore("0")
	outW.Close()
	errW.Close()
	if startErr != nil {
		readers.Wait()
		outR.Close()
		errR.Close()
		res.Stderr = base64.StdEncoding.EncodeToString([]byte("kiln: starting the step: " + startErr.Error()))
		return res
	}
	var expired atomic.Bool
	timerDone := make(chan struct{})
	timer := time.AfterFunc(time.Duration(s.TimeoutMs)*time.Millisecond, func() {
		defer close(timerDone)
		expired.Store(true)
		killAll()
	})
	state, waitErr := cmd.Process.Wait()
	if !timer.Stop() {
		<-timerDone // its killAll ends here: never in the middle of the next call (its helpers run as uid 1000 too)
	}
	res.TimedOut = expired.Load()
	res.WallUs = time.Since(started).Microseconds()
	// Whatever the step started in the background ends with it; then its pipes reach EOF.
	res.Killed = killAll()
	readers.Wait()
	outR.Close()
	errR.Close()
	if waitErr == nil && state != nil {
		if ru, ok := state.SysUsage().(*syscall.Rusage); ok {
			res.CPUUs = ru.Utime.Sec*1e6 + int64(ru.Utime.Usec) + ru.Stime.Sec*1e6 + int64(ru.Stime.Usec)
		}
		if ws, ok := state.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			res.Signal = int(ws.Signal())
		} else if !res.TimedOut {
			code := state.ExitCode()
			res.ExitCode = &code
		}
	}
	res.Stdout = base64.StdEncoding.EncodeToString(stdout.buf.Bytes())
	res.Stderr = base64.StdEncoding.EncodeToString(stderr.buf.Bytes())
	res.StdoutTruncated, res.StderrTruncated = stdout.cut, stderr.cut
	return res
}

// stdinFile: the step's stdin as a read-only descriptor of an unlinked file in /kiln (root's), so no copying
// goroutine and no pipe outlive a step that never reads it.
func stdinFile(encoded string) (*os.File, error) {
	data, err := base64.StdEncoding.DecodeString(encoded)
	if err != nil {
		return nil, err
	}
	f, err := os.CreateTemp("/kiln", "stdin-*")
	if err != nil {
		return nil, err
	}
	name := f.Name()
	defer os.Remove(name)
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	return os.Open(name)
}

// untrustedPids lists the live (not zombie) processes of uid 1000 in this container.
func untrustedPids() []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		status, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil {
			continue
		}
		uid, zombie := -1, false
		for _, line := range strings.Split(string(status), "\n") {
			if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
				if fields := strings.Fields(rest); len(fields) > 0 {
					uid, _ = strconv.Atoi(fields[0])
				}
			} else if rest, ok := strings.CutPrefix(line, "State:"); ok {
				zombie = strings.HasPrefix(strings.TrimSpace(rest), "Z")
			}
		}
		if uid == untrusted && !zombie {
			pids = append(pids, pid)
		}
	}
	return pids
}

// killAll SIGKILLs every uid-1000 process until none is left (a fork bomb runs out of parents); the number
// killed, or -1 when some survive.
func killAll() int {
	killed := 0
	for round := 0; round < 200; round++ {
		pids := untrustedPids()
		if len(pids) == 0 {
			return killed
		}
		for _, pid := range pids {
			if syscall.Kill(pid, syscall.SIGKILL) == nil {
				killed++
			}
		}
		time.Sleep(time.Duration(round) * time.Millisecond)
	}
	return -1
}

func oomScore(value string) {
	_ = os.WriteFile("/proc/self/oom_score_adj", []byte(value), 0)
}

// --- helpers (uid 1000) ------------------------------------------------------------------------------------------

func inside(root, rel string) (string, error) {
	clean := filepath.Clean(rel)
	if rel == "" || strings.ContainsRune(rel, 0) || filepath.IsAbs(rel) || clean == ".." ||
		strings.HasPrefix(clean, "../") {
		return "", fmt.Errorf("path %q must be relative and stay inside %s", rel, root)
	}
	return filepath.Join(root, clean), nil
}

func prepare() error {
	var c call
	if err := json.NewDecoder(os.Stdin).Decode(&c); err != nil {
		return err
	}
	if err := restoreBase(); err != nil {
		return err
	}
	for _, f := range c.Files {
		target, err := inside("/work", f.Path)
		if err != nil {
			return err
		}
		data, err := base64.StdEncoding.DecodeString(f.Data)
		if err != nil {
			return fmt.Errorf("%s: %v", f.Path, err)
		}
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return err
		}
		mode := os.FileMode(f.Mode & 0o777)
		if mode == 0 {
			mode = 0o644
		}
		os.Remove(target) // a file of the image's /work is replaced, not written through
		if err := os.WriteFile(target, data, mode); err != nil {
			return err
		}
		if err := os.Chmod(target, mode); err != nil {
			return err
		}
	}
	if c.Cwd != "" {
		dir, err := inside("/work", c.Cwd)
		if err != nil {
			return err
		}
		return os.MkdirAll(dir, 0o755)
	}
	return nil
}

func restoreBase() error {
	f, err := os.Open(baseTar)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	defer f.Close()
	reader := tar.NewReader(f)
	for {
		h, err := reader.Next()
		if errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return err
		}
		name := strings.TrimPrefix(h.Name, "./")
		if name == "" || name == "." {
			continue
		}
		target, err := inside("/work", name)
		if err != nil {
			return err
		}
		mode := os.FileMode(h.Mode & 0o777)
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(target, 0o755); err != nil {
				return err
			}
			os.Chmod(target, mode|0o700)
		case tar.TypeReg:
			os.MkdirAll(filepath.Dir(target), 0o755)
			out, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY|os.O_TRUNC|syscall.O_NOFOLLOW, mode|0o600)
			if err != nil {
				return err
			}
			_, err = io.Copy(out, reader)
			out.Close()
			if err != nil {
				return err
			}
			os.Chmod(target, mode)
		case tar.TypeSymlink:
			os.MkdirAll(filepath.Dir(target), 0o755)
			if err := os.Symlink(h.Linkname, target); err != nil {
				return err
			}
		}
	}
}

func fetch() error {
	var args struct {
		Paths []string `json:"paths"`
		Cwd   string   `json:"cwd"`
		Cap   int      `json:"cap"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&args); err != nil {
		return err
	}
	out := struct {
		Files   map[string]string `json:"files"`
		Missing []string          `json:"missing"`
	}{map[string]string{}, []string{}}
	total := 0
	for _, p := range args.Paths {
		var target string
		var err error
		if strings.HasPrefix(p, "/tmp/") { // reports written under /tmp by a test command
			target, err = inside("/tmp", strings.TrimPrefix(p, "/tmp/"))
		} else {
			target, err = inside(filepath.Join("/work", args.Cwd), p)
		}
		if err != nil {
			out.Missing = append(out.Missing, p)
			continue
		}
		for _, found := range expand(target) {
			real, err := filepath.EvalSymlinks(found)
			if err != nil || !(strings.HasPrefix(real, "/work/") || strings.HasPrefix(real, "/tmp/")) {
				continue
			}
			info, err := os.Lstat(real)
			if err != nil || !info.Mode().IsRegular() || total+int(info.Size()) > args.Cap {
				continue
			}
			data, err := os.ReadFile(real)
			if err != nil {
				continue
			}
			total += len(data)
			key := p
			if found != target { // below a directory asked for with a trailing "/"
				rel, _ := filepath.Rel(target, found)
				key = p + rel
			}
			out.Files[key] = base64.StdEncoding.EncodeToString(data)
		}
		if _, ok := out.Files[p]; !ok && !strings.HasSuffix(p, "/") {
			out.Missing = append(out.Missing, p)
		}
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

// expand: a path ending in "/" means every regular file below that directory.
func expand(target string) []string {
	info, err := os.Lstat(target)
	if err != nil || !info.IsDir() {
		return []string{target}
	}
	var found []string
	filepath.WalkDir(target, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() && len(found) < 10000 {
			found = append(found, p)
		}
		return nil
	})
	return found
}

func wipe() error {
	var problems []string
	for _, dir := range writable {
		if err := emptyDir(dir); err != nil {
			problems = append(problems, err.Error())
		}
		if left := remaining(dir); left > 0 {
			problems = append(problems, fmt.Sprintf("%s keeps %d entries", dir, left))
		}
	}
	if err := removeIPC(); err != nil {
		problems = append(problems, err.Error())
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

func emptyDir(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		// A directory the call made unreadable (it owns it): give it back its rights first.
		os.Chmod(dir, 0o700)
		if entries, err = os.ReadDir(dir); err != nil {
			return err
		}
	}
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		if e.IsDir() {
			os.Chmod(path, 0o700)
			if err := emptyDir(path); err != nil {
				return err
			}
		}
		if mountPoint(path) { // an image VOLUME's tmpfs inside a work area: emptied, kept
			continue
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return nil
}

// mountPoint: whether path is a directory another filesystem is mounted on.
func mountPoint(path string) bool {
	var own, parent syscall.Stat_t
	if syscall.Lstat(path, &own) != nil || syscall.Lstat(filepath.Dir(path), &parent) != nil {
		return false
	}
	return own.Mode&syscall.S_IFMT == syscall.S_IFDIR && own.Dev != parent.Dev
}

// remaining counts what is left below dir, an empty mount point not counted.
func remaining(dir string) int {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	left := 0
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		if mountPoint(path) {
			left += remaining(path)
		} else {
			left++
		}
	}
	return left
}

// removeIPC removes the System V shared memory, message queues and semaphores left in this IPC namespace.
func removeIPC() error {
	kinds := []struct {
		file  string
		call  uintptr
		idCol int
	}{{"/proc/sysvipc/shm", syscall.SYS_SHMCTL, 1}, {"/proc/sysvipc/msg", syscall.SYS_MSGCTL, 1},
		{"/proc/sysvipc/sem", syscall.SYS_SEMCTL, 1}}
	var left []string
	for _, k := range kinds {
		for attempt := 0; attempt < 2; attempt++ {
			data, err := os.ReadFile(k.file)
			if err != nil {
				break
			}
			lines := strings.Split(strings.TrimSpace(string(data)), "\n")
			ids := []int{}
			for _, line := range lines[1:] {
				fields := strings.Fields(line)
				if len(fields) > k.idCol {
					if id, err := strconv.Atoi(fields[k.idCol]); err == nil {
						ids = append(ids, id)
					}
				}
			}
			if len(ids) == 0 {
				break
			}
			if attempt == 1 {
				left = append(left, fmt.Sprintf("%s keeps %d objects", k.file, len(ids)))
				break
			}
			for _, id := range ids {
				if k.call == syscall.SYS_SEMCTL {
					syscall.Syscall6(k.call, uintptr(id), 0, 0 /* IPC_RMID */, 0, 0, 0)
				} else {
					syscall.Syscall(k.call, uintptr(id), 0 /* IPC_RMID */, 0)
				}
			}
		}
	}
	if len(left) > 0 {
		return errors.New(strings.Join(left, "; "))
	}
	return nil
}
