// Builds the chat page into ../static (committed: the gateway serves it and needs no Node).
// Stable names (chat.js, chat.css): the gateway serves /static/ as plain files.
import { defineConfig } from "vite";

export default defineConfig({
  base: "/static/",
  build: {
    outDir: "../static", emptyOutDir: true, sourcemap: false, target: "es2022",
    rollupOptions: { output: { entryFileNames: "chat.js", assetFileNames: "chat.[ext]" } },
  },
});
