// Builds the chat page into ../static (committed: the gateway serves it and needs no Node).
// Stable names (chat.js, chat.css): the gateway serves /static/ as plain files. The build also
// writes source.sha256, the hash of what it was built from, so a test can tell a stale build.
import { createHash } from "node:crypto";
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { defineConfig } from "vite";

const SOURCES = ["index.html", "package-lock.json", "vite.config.js",
  ...readdirSync("src").sort().map((name) => join("src", name))];

function sourceHash() {
  return {
    name: "source-hash",
    generateBundle() {
      const hash = createHash("sha256");
      for (const path of SOURCES) hash.update(`${path}\n`).update(readFileSync(path)).update("\n");
      this.emitFile({ type: "asset", fileName: "source.sha256", source: `${hash.digest("hex")}\n` });
    },
  };
}

export default defineConfig({
  base: "/static/",
  plugins: [sourceHash()],
  build: {
    outDir: "../static", emptyOutDir: true, sourcemap: false, target: "es2022",
    rollupOptions: { output: { entryFileNames: "chat.js", assetFileNames: "chat.[ext]" } },
  },
});
